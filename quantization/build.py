"""quantization.build: Llama4.build with the quantized loader wired in."""

from functools import partial
from llama_lite.generation import Llama4

from .convert import convert_to_quantized_model
from .modes import parse_mode


def build(ckpt_dir, quantization_mode="none", *, targets=None, group_size: int = 128,
          fp8_activation_scale_ub: float = 1200.0, nvfp4_activation_amax=None, progress: bool = True,
          **build_kwargs) -> Llama4:
    """``Llama4.build`` with ``convert_to_quantized_model`` as the loader.

    Mode ``none`` quantizes nothing: on a bf16 folder the weights are the checkpoint's bf16
    tensors, and on a CPU the linear layers run on the kernels' bf16 GEMV (see
    ``quantization.modules.KernelLinear``); on a pre-quantized folder it fails with a message
    naming the mode the folder was written with. A Hugging Face quantized folder (compressed-tensors,
    fbgemm_fp8) runs in the mode its ``quantization_config`` maps to when ``none`` is given; another
    mode is an error (except ``w4a8`` from int4 weights, derived from their group scales).
    """
    mode = parse_mode(quantization_mode)
    convert = partial(
        convert_to_quantized_model, quantization_mode=mode, targets=targets, group_size=group_size,
        fp8_activation_scale_ub=fp8_activation_scale_ub, nvfp4_activation_amax=nvfp4_activation_amax,
        progress=progress,
    )
    llama = Llama4.build(ckpt_dir, convert=convert, **build_kwargs)
    llama.quantization_mode = getattr(llama.model, "quantization_mode", mode.value)
    return llama
