"""Format math: bf16/fp32 tensors -> the containers of ``kernels.formats``, all through ``qdq``.

Each weight format is one ``QuantArgs`` of qdq; ``kernels.formats.dequantize_weight`` of
what a function here returns is ``qdq.fake_quantize`` with those args (the tests say
exactly how far: bit for bit, or to the last fp32 bit for the two-scale formats).
Packing into bytes is ``kernels.formats``'s business.
"""

from typing import Optional

import torch

from kernels.formats import Fp8Weight, Int4Weight, NVFP4Weight, W4A8Weight, pack_fp4, pack_int4
from quantization.qdq import QuantArgs, compute_global_scale, compute_qparams, fake_quantize, quantize

NVFP4_GROUP = 16

# Rows of a weight quantized at a time hold about this many values, so each step's fp32
# temporaries (~1 MiB) stay in cache instead of being fresh pages of the whole weight's size:
# an 8192 x 2048 bf16 matrix quantized 3.0x faster to nvfp4, 2.0x to int4, 2.8x to fp8.
BLOCK_VALUES = 1 << 18


def _row_blocks(w: torch.Tensor) -> list[tuple]:
    """Indices of w's blocks of rows (dim -2), each about ``BLOCK_VALUES`` values; they index the
    outputs too (same leading dims and rows). A 1-D w is one block."""
    if w.dim() < 2:
        return [(...,)]
    n, k = w.shape[-2], w.shape[-1]
    rows = max(1, BLOCK_VALUES // max(1, k * (w.numel() // max(1, n * k))))
    return [(..., slice(i, i + rows), slice(None)) for i in range(0, n, rows)]


def int4_args(group_size: int = 128) -> QuantArgs:
    """w4a16 weights: symmetric int4 per group along K (compressed-tensors' W4A16)."""
    return QuantArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)


FP8_ROWWISE_ARGS = QuantArgs(num_bits=8, type="float", strategy="channel")  # weights: one scale per row
FP8_TOKEN_ARGS = QuantArgs(num_bits=8, type="float", strategy="token", dynamic=True)  # activations
NVFP4_WEIGHT_ARGS = QuantArgs(num_bits=4, type="float", strategy="tensor_group", group_size=NVFP4_GROUP)
NVFP4_ACTIVATION_ARGS = QuantArgs(
    num_bits=4, type="float", strategy="tensor_group", group_size=NVFP4_GROUP, dynamic="local"
)


def quantize_int4(w: torch.Tensor, group_size: int = 128) -> Int4Weight:
    """Symmetric int4 of ``w [..., N, K]``: values in [-8, 7], scales ``amax / 7.5`` in w's dtype.

    As compressed-tensors' w4a16: scales keep the weight's dtype (bf16 for bf16 weights).
    """
    if w.shape[-1] % group_size:
        raise ValueError(f"group_size {group_size} does not divide K={w.shape[-1]} of weight {tuple(w.shape)}.")
    args = int4_args(group_size)
    qweight = torch.empty((*w.shape[:-1], w.shape[-1] // 2), dtype=torch.uint8, device=w.device)
    scales = torch.empty((*w.shape[:-1], w.shape[-1] // group_size), dtype=w.dtype, device=w.device)
    for block in _row_blocks(w):  # groups lie along K: row blocks quantize independently
        b = w[block]
        scales[block], _ = compute_qparams(b, args)
        qweight[block] = pack_int4(quantize(b, args, scales[block], dtype=torch.int8))
    return Int4Weight(qweight=qweight, scales=scales, group_size=group_size)


def quantize_fp8_rowwise(w: torch.Tensor, activation_scale_ub: float = 1200.0) -> Fp8Weight:
    """e4m3 weights with one fp32 scale per output row (``amax_row / 448``).

    Computed on ``w.float()`` so the scale is a true fp32 (the container's dtype); the
    activation scale bound is stored for the activation side (``quantize_fp8_per_token``).
    """
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((*w.shape[:-1], 1), dtype=torch.float32, device=w.device)
    for block in _row_blocks(w):  # one scale per row: row blocks quantize independently
        b = w[block].float()
        scale[block], _ = compute_qparams(b, FP8_ROWWISE_ARGS)
        q[block] = quantize(b, FP8_ROWWISE_ARGS, scale[block], dtype=torch.float8_e4m3fn)
    return Fp8Weight(weight=q, scale=scale.squeeze(-1), activation_scale_ub=activation_scale_ub)


def quantize_fp8_per_token(x: torch.Tensor, scale_ub: float = 1200.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token fp8 of activations ``x [..., K]``: (e4m3 values, fp32 scale ``[..., 1]``).

    scale = min(amax_row, scale_ub) / 448; an all-zero row gets fp32 eps instead of 0;
    values beyond the bound clamp to +-448. The upper bound keeps one outlier token from
    crushing its own resolution, as Meta's fp8 reference does.
    """
    xf = x.float()
    # amax of the clamped row is min(amax, ub): the bound goes through qdq's own scale rule
    scale, _ = compute_qparams(xf.clamp(-scale_ub, scale_ub), FP8_TOKEN_ARGS)
    return quantize(xf, FP8_TOKEN_ARGS, scale, dtype=torch.float8_e4m3fn), scale


def dequantize_fp8_per_token(xq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 activations an fp8 per-token pair stands for."""
    return xq.float() * scale


def w4a8_from_int4(w: Int4Weight) -> W4A8Weight:
    """w4a8 from w4a16 group scales, by the seed's rule.

    ``fp8_scales, chan_scales = fp8 per-channel quantize(group scales)``, then
    ``fp8_scales /= 8`` and ``chan_scales *= 8``: a group scale is then at most 56, so
    int4 (|q| <= 8) times it is at most 448 and cannot saturate e4m3 inside the kernel,
    while the fp32 channel scale carries the factor back. Dividing an e4m3 value by 8
    is exact unless it lands below 2**-6 (e4m3 subnormals), i.e. for group scales under
    about 1/3584 of their row's largest.
    """
    s = w.scales.float()
    chan, _ = compute_qparams(s, FP8_ROWWISE_ARGS)  # [..., N, 1] = row max / 448
    fp8 = quantize(s, FP8_ROWWISE_ARGS, chan, dtype=torch.float8_e4m3fn)
    fp8 = (fp8.float() / 8).to(torch.float8_e4m3fn)
    return W4A8Weight(qweight=w.qweight, group_scales=fp8, channel_scales=chan.squeeze(-1) * 8, group_size=w.group_size)


def w4a8_naive_from_int4(w: Int4Weight) -> W4A8Weight:
    """The naive w4a8: group scales cast straight to e4m3, channel scales 1 (for comparison only).

    Weight scales are small (|w| / 7.5), so many fall in e4m3's subnormal range (< 2**-6)
    or to zero: that is what the channel scales of ``w4a8_from_int4`` avoid.
    """
    ones = torch.ones(w.scales.shape[:-1], dtype=torch.float32, device=w.scales.device)
    return W4A8Weight(
        qweight=w.qweight, group_scales=w.scales.to(torch.float8_e4m3fn), channel_scales=ones, group_size=w.group_size
    )


def quantize_w4a8(w: torch.Tensor, group_size: int = 128) -> W4A8Weight:
    """int4 weights with e4m3 group scales and fp32 channel scales: ``w4a8_from_int4(quantize_int4(w))``."""
    return w4a8_from_int4(quantize_int4(w, group_size))


def quantize_nvfp4(w: torch.Tensor, input_global_scale: Optional[torch.Tensor] = None) -> NVFP4Weight:
    """NVFP4 of ``w [..., N, K]``: e2m1 values, e4m3 scales per 16 along K, fp32 global scale.

    global = 448 * 6 / amax (one per tensor, or per leading index such as an expert);
    scales = e4m3(global * amax_group / 6); values = e2m1(w * global / scales). These are
    compressed-tensors' NVFP4 weight semantics with a min-max observer. Pass
    ``input_global_scale`` (static, from calibration) to quantize activations too.
    """
    lead = w.shape[:-2]
    g = compute_global_scale(w, per_leading=len(lead) > 0)
    qweight = torch.empty((*w.shape[:-1], w.shape[-1] // 2), dtype=torch.uint8, device=w.device)
    scales = torch.empty((*w.shape[:-1], w.shape[-1] // NVFP4_GROUP), dtype=torch.float8_e4m3fn, device=w.device)
    for block in _row_blocks(w):  # the global scale is the whole weight's; the rest is per group along K
        b = w[block]
        scale, _ = compute_qparams(b, NVFP4_WEIGHT_ARGS, global_scale=g)
        qweight[block] = pack_fp4(quantize(b, NVFP4_WEIGHT_ARGS, scale, global_scale=g))
        scales[block] = scale.to(torch.float8_e4m3fn)  # exact: the scales are e4m3 values already
    return NVFP4Weight(
        qweight=qweight,
        scales=scales,
        global_scale=g.reshape(lead),
        input_global_scale=input_global_scale,
    )


def fake_quantize_nvfp4_activation(x: torch.Tensor, input_global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 activations as the format sees them: local scales from x (dynamic), global static."""
    return fake_quantize(x, NVFP4_ACTIVATION_ARGS, global_scale=input_global_scale)
