# QDQ reference and format math (torch only; no heavy imports here)
from quantization.qdq import (
    QuantArgs,
    compute_global_scale,
    compute_qparams,
    dequantize,
    fake_quantize,
    quantize,
)
from quantization.formats import (
    fake_quantize_nvfp4_activation,
    quantize_fp8_per_token,
    quantize_fp8_rowwise,
    quantize_int4,
    quantize_nvfp4,
    quantize_w4a8,
    w4a8_from_int4,
    w4a8_naive_from_int4,
)

from quantization.modes import ALL_TARGETS, DEFAULT_TARGETS, QuantizationMode  # noqa: E402
from quantization.convert import convert_to_quantized_model, quantize_weight  # noqa: E402
from quantization.build import build  # noqa: E402
