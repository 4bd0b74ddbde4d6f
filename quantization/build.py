"""quantization.build: Llama4.build with the quantized loader wired in."""

from functools import partial
from pathlib import Path

from llama_lite.generation import Llama4

from .checkpoint_io import read_quant_config
from .convert import convert_to_quantized_model
from .modes import QuantizationMode, parse_mode


def build(ckpt_dir, quantization_mode="none", *, targets=None, group_size: int = 128,
          fp8_activation_scale_ub: float = 1200.0, nvfp4_activation_amax=None, progress: bool = True,
          **build_kwargs) -> Llama4:
    """``Llama4.build`` with ``convert_to_quantized_model`` as the loader.

    Mode ``none`` on a bf16 folder is the plain bf16 build; on a pre-quantized folder it fails
    with a message naming the mode the folder was written with.
    """
    mode = parse_mode(quantization_mode)
    path = Path(ckpt_dir).expanduser()
    if mode == QuantizationMode.none and not (path.is_dir() and read_quant_config(path) is not None):
        return Llama4.build(ckpt_dir, **build_kwargs)
    convert = partial(
        convert_to_quantized_model, quantization_mode=mode, targets=targets, group_size=group_size,
        fp8_activation_scale_ub=fp8_activation_scale_ub, nvfp4_activation_amax=nvfp4_activation_amax,
        progress=progress,
    )
    llama = Llama4.build(ckpt_dir, convert=convert, **build_kwargs)
    llama.quantization_mode = mode.value
    return llama
