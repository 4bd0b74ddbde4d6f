"""Weight containers for every quantized format, and their byte packing.

Each container holds the packed tensors exactly as they are stored in a checkpoint.
Shapes follow ``nn.Linear``: ``[..., N, K]`` (out features, in features); a leading
expert dimension ``E`` is allowed for grouped (MoE) kernels. Fast paths may cache
re-packed forms in ``prepared`` (built once at load by ``kernels.prepare``).

Packing of 4-bit values: two per byte along K, the even index in the low nibble.
"""

from dataclasses import dataclass, field
from typing import Optional

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1
# e2m1 code -> value; bit 3 is the sign
FP4_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], shape [..., K] (K even) -> uint8 [..., K // 2]."""
    if q.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd last dimension ({q.shape[-1]}) into bytes")
    q = q.to(torch.int8)
    # In int8 the shift drops the high nibble's sign bits and the OR leaves the byte (0.07 s against
    # 0.24 s in int16 for a 64 Mi-value expert stack).
    return ((q[..., 0::2] & 0xF) | (q[..., 1::2] << 4)).view(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K // 2] -> int8 values in [-8, 7], shape [..., K]."""
    p = packed.to(torch.int16)
    lo, hi = p & 0xF, (p >> 4) & 0xF
    q = torch.stack((lo, hi), dim=-1).flatten(-2)
    return torch.where(q >= 8, q - 16, q).to(torch.int8)


# e2m1 code of every bf16 bit pattern (as an unsigned 16-bit index), -1 where it is not an e2m1 value
_FP4_CODE_BY_BF16_BITS = torch.full((1 << 16,), -1, dtype=torch.int8)
_FP4_CODE_BY_BF16_BITS[FP4_VALUES.to(torch.bfloat16).view(torch.int16).long() & 0xFFFF] = torch.arange(16, dtype=torch.int8)


def fp4_codes(values: torch.Tensor) -> torch.Tensor:
    """Values already on the e2m1 grid -> 4-bit codes (uint8). Off-grid values are an error."""
    b = values if values.dtype == torch.bfloat16 else values.to(torch.bfloat16)
    # every e2m1 value is a bf16 value; one that only rounds to one is off the grid
    exact = b is values or bool((b.float() == values.float()).all())
    # one lookup per value (index_select with int32 indices: 4x faster than decoding magnitude
    # and sign apart, 2x faster than tensor indexing)
    bits = (b.view(torch.int16).int() & 0xFFFF).reshape(-1)
    code = _FP4_CODE_BY_BF16_BITS.to(b.device).index_select(0, bits).view(b.shape)
    if not exact or (code.numel() and int(code.min()) < 0):
        raise ValueError("fp4_codes expects values on the e2m1 grid; quantize them first")
    return code.view(torch.uint8)


def pack_fp4(values: torch.Tensor) -> torch.Tensor:
    """e2m1 values [..., K] -> uint8 [..., K // 2]."""
    c = fp4_codes(values)
    if c.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd last dimension ({c.shape[-1]}) into bytes")
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K // 2] -> float32 e2m1 values [..., K]."""
    p = packed.to(torch.int64)
    codes = torch.stack((p & 0xF, (p >> 4) & 0xF), dim=-1).flatten(-2)
    return FP4_VALUES.to(packed.device)[codes]


@dataclass
class Int4Weight:
    """w4a16: symmetric int4, one scale per ``group_size`` elements along K; activations stay bf16.

    ``int8_activations``: an explicit, lossy option of the engine, not of the checkpoint: the
    activations are quantized to int8 per 32 values along K (``reference.quantize_int8_blocks``)
    before they meet the weights, for integer dot products on CPUs.
    """

    qweight: torch.Tensor  # uint8 [..., N, K // 2]
    scales: torch.Tensor  # bf16 or fp32 [..., N, K // group_size]
    group_size: int = 128
    int8_activations: bool = False
    prepared: dict = field(default_factory=dict, repr=False)


@dataclass
class Fp8Weight:
    """fp8 rowwise (w8a8): e4m3 weights, one fp32 scale per output row; activations per-token fp8."""

    weight: torch.Tensor  # float8_e4m3fn [..., N, K]
    scale: torch.Tensor  # fp32 [..., N]
    activation_scale_ub: float = 1200.0
    prepared: dict = field(default_factory=dict, repr=False)


@dataclass
class W4A8Weight:
    """int4 weights with fp8-e4m3 group scales and fp32 per-channel scales; fp8 per-token activations."""

    qweight: torch.Tensor  # uint8 [..., N, K // 2]
    group_scales: torch.Tensor  # float8_e4m3fn [..., N, K // group_size]
    channel_scales: torch.Tensor  # fp32 [..., N]
    group_size: int = 128
    activation_scale_ub: float = 1200.0
    prepared: dict = field(default_factory=dict, repr=False)


@dataclass
class NVFP4Weight:
    """e2m1 weights, e4m3 scales per 16 elements, one fp32 global scale (per tensor / per expert).

    With ``input_global_scale`` set, activations are quantized to nvfp4 too (dynamic local
    scales, that static global scale); otherwise activations stay bf16.
    """

    qweight: torch.Tensor  # uint8 [..., N, K // 2]
    scales: torch.Tensor  # float8_e4m3fn [..., N, K // 16]
    global_scale: torch.Tensor  # fp32 [] or [E]
    input_global_scale: Optional[torch.Tensor] = None  # fp32 [] or [E]
    prepared: dict = field(default_factory=dict, repr=False)


QuantizedWeight = Int4Weight | Fp8Weight | W4A8Weight | NVFP4Weight


def _expand_groups(scales: torch.Tensor, k: int) -> torch.Tensor:
    return scales.float().repeat_interleave(k // scales.shape[-1], dim=-1)


def dequantize_weight(w: QuantizedWeight) -> torch.Tensor:
    """The fp32 weight [..., N, K] a container stands for: the numerical definition of each format."""
    if isinstance(w, Int4Weight):
        q = unpack_int4(w.qweight).float()
        return q * _expand_groups(w.scales, q.shape[-1])
    if isinstance(w, Fp8Weight):
        return w.weight.float() * w.scale.float().unsqueeze(-1)
    if isinstance(w, W4A8Weight):
        q = unpack_int4(w.qweight).float()
        return q * _expand_groups(w.group_scales, q.shape[-1]) * w.channel_scales.float().unsqueeze(-1)
    if isinstance(w, NVFP4Weight):
        v = unpack_fp4(w.qweight)
        g = w.global_scale.float().reshape(*w.global_scale.shape, *([1] * 2))
        return v * (_expand_groups(w.scales, v.shape[-1]) / g)  # this order matches compressed-tensors
    raise TypeError(f"not a quantized weight: {type(w).__name__}")


# ---- helpers for kernels (added for kernels/reference.py, kernels/cpu.py, kernels/dispatch.py)


def format_name(w: "QuantizedWeight | torch.Tensor") -> str:
    """Short name of a weight's format: bf16 (any plain tensor), int4, fp8, w4a8, nvfp4, nvfp4_w4a4."""
    if isinstance(w, torch.Tensor):
        return "bf16" if w.dtype == torch.bfloat16 else str(w.dtype).removeprefix("torch.")
    if isinstance(w, Int4Weight):
        return "int4"
    if isinstance(w, Fp8Weight):
        return "fp8"
    if isinstance(w, W4A8Weight):
        return "w4a8"
    if isinstance(w, NVFP4Weight):
        return "nvfp4" if w.input_global_scale is None else "nvfp4_w4a4"
    raise TypeError(f"not a weight: {type(w).__name__}")


def weight_shape(w: "QuantizedWeight | torch.Tensor") -> tuple[Optional[int], int, int]:
    """(E or None, N, K) of a weight: E is the leading expert dimension, when there is one."""
    data = w if isinstance(w, torch.Tensor) else (w.weight if isinstance(w, Fp8Weight) else w.qweight)
    if data.dim() not in (2, 3):
        raise ValueError(f"weights are [N, K] or [E, N, K]; got shape {tuple(data.shape)}")
    n, k = data.shape[-2], data.shape[-1]
    if not isinstance(w, (torch.Tensor, Fp8Weight)):
        k *= 2  # two 4-bit values per byte
    return (data.shape[0] if data.dim() == 3 else None), n, k


def select_expert(w: "QuantizedWeight | torch.Tensor", e: int) -> "QuantizedWeight | torch.Tensor":
    """Expert ``e`` of a weight with a leading expert dimension, as a 2-D weight of the same format.

    Per-tensor global scales (0-d) are shared by all experts and kept as they are.
    """
    if isinstance(w, torch.Tensor):
        return w[e]

    def pick(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return t if t is None or t.dim() == 0 else t[e]

    if isinstance(w, Int4Weight):
        return Int4Weight(w.qweight[e], w.scales[e], w.group_size, w.int8_activations)
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.weight[e], w.scale[e], w.activation_scale_ub)
    if isinstance(w, W4A8Weight):
        return W4A8Weight(w.qweight[e], w.group_scales[e], w.channel_scales[e], w.group_size, w.activation_scale_ub)
    if isinstance(w, NVFP4Weight):
        return NVFP4Weight(w.qweight[e], w.scales[e], pick(w.global_scale), pick(w.input_global_scale))
    raise TypeError(f"not a quantized weight: {type(w).__name__}")
