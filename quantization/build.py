"""quantization.build: Llama4.build with the quantized loader wired in."""

from functools import partial

import torch

import kernels
from llama_lite.errors import ConfigError
from llama_lite.generation import Llama4

from .convert import convert_to_quantized_model
from .modes import parse_mode


def build(ckpt_dir, quantization_mode="none", *, targets=None, group_size: int = 128,
          fp8_activation_scale_ub: float = 1200.0, nvfp4_activation_amax=None, progress: bool = True,
          int8_activations: bool = False, **build_kwargs) -> Llama4:
    """``Llama4.build`` with ``convert_to_quantized_model`` as the loader.

    Mode ``none`` quantizes nothing: on a bf16 folder the weights are the checkpoint's bf16
    tensors, and on a CPU the linear layers run on the kernels' bf16 GEMV (see
    ``quantization.modules.KernelLinear``); on a pre-quantized folder it fails with a message
    naming the mode the folder was written with. A Hugging Face quantized folder (compressed-tensors,
    fbgemm_fp8) runs in the mode its ``quantization_config`` maps to when ``none`` is given; another
    mode is an error (except ``w4a8`` from int4 weights, derived from their group scales).

    ``int8_activations``: the int4 (w4a16) layers quantize their activations to int8 per 32
    values and multiply with integer dot products (``kernels.Int4Weight.int8_activations``):
    faster on CPUs, and lossy -- an explicit choice, never a default.
    """
    mode = parse_mode(quantization_mode)
    convert = partial(
        convert_to_quantized_model, quantization_mode=mode, targets=targets, group_size=group_size,
        fp8_activation_scale_ub=fp8_activation_scale_ub, nvfp4_activation_amax=nvfp4_activation_amax,
        progress=progress,
    )
    if int8_activations:  # set before Llama4.build compiles or warms up the model
        convert = partial(_then_int8_activations, convert)
    llama = Llama4.build(ckpt_dir, convert=convert, **build_kwargs)
    llama.quantization_mode = getattr(llama.model, "quantization_mode", mode.value)
    llama.int8_activations = bool(int8_activations)
    return llama


def _then_int8_activations(convert, model, checkpoint):
    model = convert(model, checkpoint)
    use_int8_activations(model)
    return model


def use_int8_activations(model: torch.nn.Module) -> int:
    """Turn on int8 activations for every int4 (w4a16) weight of ``model``; returns how many.

    A ConfigError where the model has none (the option belongs to int4 weights: mode int4_mixed).
    """
    weights = [w for m in model.modules() for w in vars(m).values() if isinstance(w, kernels.Int4Weight)]
    if not weights:
        raise ConfigError("int8 activations apply to int4 weights; this model has none (use mode int4_mixed)")
    for w in weights:
        w.int8_activations = True
        w.prepared.clear()  # the prepared forms depend on it
        kernels.prepare(w)
    return len(weights)
