"""Pure-torch reference kernels: dequantize, then matmul in fp32. The ground truth for every path.

Numerics (all computed in fp32; the result is cast to ``x.dtype`` once, at the end):

* plain weight (bf16 ...): ``x @ W.T``.
* int4 (w4a16), nvfp4 weights-only: ``x @ dequantize_weight(w).T``; activations used as given.
* int4 with ``int8_activations``: per-32 int8 activations (``fake_quantize_int8_activations``),
  ``out = x_deq @ W_deq.T``.
* fp8 rowwise and w4a8: per-token dynamic fp8 activations (``quantize_fp8_per_token``),
  ``out = (xq @ W_deq.T) * s``.
* nvfp4 with ``input_global_scale``: per-token, per-16 nvfp4 activations
  (``fake_quantize_nvfp4_activations``), ``out = x_deq @ W_deq.T``.
* SwiGLU: ``h = silu(x W1.T) * (x W3.T)`` with both products in fp32, ``h`` cast to ``x.dtype``
  (the activation dtype, as the unfused model would store it), then ``linear(h, W2)``.
* grouped: rows ``offsets[e]:offsets[e+1]`` use expert ``e``; rows outside ``offsets[0]:offsets[E]``
  are zero.

Functions here are also the activation quantizers the fast paths must match bit for bit.
"""

import torch
import torch.nn.functional as F

from .formats import (
    FP4_MAX,
    FP8_MAX,
    Fp8Weight,
    Int4Weight,
    NVFP4Weight,
    QuantizedWeight,
    W4A8Weight,
    dequantize_weight,
    select_expert,
    weight_shape,
)

Weight = QuantizedWeight | torch.Tensor
NVFP4_BLOCK = 16


# ---- activation quantization


def _div(a: torch.Tensor, b: float) -> torch.Tensor:
    """``a / b`` correctly rounded on every device. On CUDA, a tensor divided by a Python number is
    computed as ``a * (1 / b)``, which is an ulp off for some ``a``: a scale an ulp off moves the
    code of every value that lands on a rounding tie (x / s = 84 against 83.99999), so the fast
    paths (which divide) and this reference would disagree on the GPU alone."""
    return a / torch.full_like(a, b)


def quantize_fp8_per_token(x: torch.Tensor, scale_ub: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (xq float8_e4m3fn [..., K], s fp32 [..., 1]) with x ~ xq * s.

    ``s = clamp(amax_K(x), max=scale_ub, min=1e-12) / 448``; ``scale_ub=None`` means no upper bound.
    """
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    if scale_ub is not None:
        amax = amax.clamp(max=scale_ub)
    s = _div(amax.clamp(min=1e-12), FP8_MAX)
    xq = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return xq, s


INT8_BLOCK = 32


def quantize_int8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K % 32 == 0) -> (a int8 [..., K], s fp32 [..., K // 32]) with x ~ a * s per block
    of 32 values: ``s = amax / 127``, ``a = round_half_even(x / s)`` (0 where s is 0), in fp32."""
    xb = x.float().reshape(*x.shape[:-1], -1, INT8_BLOCK)
    s = _div(xb.abs().amax(dim=-1, keepdim=True), 127.0)
    a = torch.where(s > 0, torch.round(xb / s), 0.0).clamp(-127, 127)
    return a.to(torch.int8).reshape(x.shape), s.squeeze(-1)


def fake_quantize_int8_activations(x: torch.Tensor) -> torch.Tensor:
    """fp32 a * s of ``quantize_int8_blocks(x)``: the values int4 weights with int8 activations multiply."""
    a, s = quantize_int8_blocks(x)
    return (a.float().reshape(*x.shape[:-1], -1, INT8_BLOCK) * s.unsqueeze(-1)).reshape(x.shape)


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 to the nearest fp4 e2m1 value (0, .5, 1, 1.5, 2, 3, 4, 6), ties to even, clamp +-6."""
    a = v.abs()
    # A tie between two neighbours goes to the one with an even mantissa (code index even):
    # comparisons are strict (>) where the lower neighbour is even, >= where the upper one is.
    r = torch.zeros_like(a)
    for threshold, value, strict in (
        (0.25, 0.5, True), (0.75, 1.0, False), (1.25, 1.5, True), (1.75, 2.0, False),
        (2.5, 3.0, True), (3.5, 4.0, False), (5.0, 6.0, True),
    ):  # fmt: skip
        r = torch.where(a > threshold if strict else a >= threshold, value, r)
    return torch.where(torch.signbit(v), -r, r)


def quantize_nvfp4_activations(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K % 16 == 0) -> (e2m1 values fp32 [..., K], local scales e4m3 [..., K // 16]).

    ``local = e4m3(min(amax_16 / 6 * g, 448))``; ``values = e2m1(x / (local / g))``. A block whose
    local scale is zero quantizes to zeros.
    """
    k = x.shape[-1]
    if k % NVFP4_BLOCK:
        raise ValueError(f"nvfp4 activations need K divisible by {NVFP4_BLOCK}; got K={k}")
    g = global_scale.float()
    xb = x.float().unflatten(-1, (k // NVFP4_BLOCK, NVFP4_BLOCK))
    amax = xb.abs().amax(dim=-1, keepdim=True)
    local = (_div(amax, FP4_MAX) * g).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    scale = local.float() / g
    values = round_to_e2m1(torch.where(scale > 0, xb / scale, 0.0))
    return values.flatten(-2), local.squeeze(-1)


def fake_quantize_nvfp4_activations(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> fp32 x_deq = e2m1(x / (local / g)) * local / g (see quantize_nvfp4_activations)."""
    values, local = quantize_nvfp4_activations(x, global_scale)
    scale = local.float() / global_scale.float()
    return (values.unflatten(-1, (-1, NVFP4_BLOCK)) * scale.unsqueeze(-1)).flatten(-2)


# ---- linear layers


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"activations have {x.shape[-1]} features but the weight expects {k}")
    return x.reshape(-1, k)


def _linear_fp32(x2: torch.Tensor, w: Weight) -> torch.Tensor:
    """x2 [M, K] times a 2-D weight, fp32 result before the final cast."""
    if isinstance(w, torch.Tensor):
        return x2.float() @ w.float().T
    wd = dequantize_weight(w)
    if isinstance(w, (Fp8Weight, W4A8Weight)):
        xq, s = quantize_fp8_per_token(x2, w.activation_scale_ub)
        return (xq.float() @ wd.T) * s
    if isinstance(w, NVFP4Weight) and w.input_global_scale is not None:
        return fake_quantize_nvfp4_activations(x2, w.input_global_scale) @ wd.T
    if isinstance(w, Int4Weight) and w.int8_activations:
        return fake_quantize_int8_activations(x2) @ wd.T
    if isinstance(w, (Int4Weight, NVFP4Weight)):
        return x2.float() @ wd.T
    raise TypeError(f"not a weight: {type(w).__name__}")


def _check_dense(w: Weight) -> tuple[int, int]:
    e, n, k = weight_shape(w)
    if e is not None:
        raise ValueError("linear() takes a 2-D weight [N, K]; use grouped_linear for [E, N, K] expert weights")
    return n, k


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x.dtype."""
    n, k = _check_dense(w)
    return _linear_fp32(_rows(x, k), w).to(x.dtype).reshape(*x.shape[:-1], n)


def swiglu(x: torch.Tensor, w1: Weight, w3: Weight, w2: Weight) -> torch.Tensor:
    """Dense SwiGLU FFN: (silu(x W1.T) * (x W3.T)) W2.T -> [..., D] in x.dtype."""
    _, k = _check_dense(w1)
    x2 = _rows(x, k)
    h = (F.silu(_linear_fp32(x2, w1)) * _linear_fp32(x2, w3)).to(x.dtype)
    out = linear(h, w2)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def check_offsets(offsets: torch.Tensor, num_experts: int, rows: int) -> list[int]:
    """offsets [E + 1] as a Python list, after checking it is a valid split of ``rows`` rows."""
    if offsets.dim() != 1 or offsets.numel() != num_experts + 1:
        raise ValueError(f"offsets must have E + 1 = {num_experts + 1} entries; got shape {tuple(offsets.shape)}")
    off = offsets.tolist()
    if off[0] < 0 or off[-1] > rows or any(b < a for a, b in zip(off, off[1:])):
        raise ValueError(f"offsets must be non-decreasing within [0, {rows}]; got {off}")
    return off


def _expert_count(w: Weight) -> int:
    e, _, _ = weight_shape(w)
    if e is None:
        raise ValueError("grouped kernels take expert weights [E, N, K]; use linear for a 2-D weight")
    return e


def grouped_linear(x: torch.Tensor, offsets: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [T, K] with rows offsets[e]:offsets[e+1] for expert e -> [T, N] in x.dtype."""
    num_e = _expert_count(w)
    _, n, k = weight_shape(w)
    off = check_offsets(offsets, num_e, x.shape[0])
    out = torch.zeros(x.shape[0], n, dtype=x.dtype, device=x.device)
    for e in range(num_e):
        if off[e + 1] > off[e]:
            out[off[e] : off[e + 1]] = linear(x[off[e] : off[e + 1]], select_expert(w, e))
    return out


def grouped_swiglu(x: torch.Tensor, offsets: torch.Tensor, w1: Weight, w3: Weight, w2: Weight) -> torch.Tensor:
    """Per expert e, on rows offsets[e]:offsets[e+1]: swiglu with W1[e], W3[e], W2[e] -> [T, D]."""
    num_e = _expert_count(w1)
    _, d, _ = weight_shape(w2)
    off = check_offsets(offsets, num_e, x.shape[0])
    out = torch.zeros(x.shape[0], d, dtype=x.dtype, device=x.device)
    for e in range(num_e):
        if off[e + 1] > off[e]:
            sl = slice(off[e], off[e + 1])
            out[sl] = swiglu(x[sl], select_expert(w1, e), select_expert(w3, e), select_expert(w2, e))
    return out


def prepare(w: Weight, device=None) -> None:
    """The reference path needs no prepared form."""


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query per row over a KV cache, in fp32: q [B, 1, H, D], keys / values [B, n, Hkv, D],
    mask [B, 1, 1, n] (True = may attend); query head h reads KV head h // (H / Hkv), scale
    1 / sqrt(D). Rows with no slot to attend to give zeros. Returns [B, 1, H, D] in q's dtype."""
    g = q.shape[2] // keys.shape[2]
    k = keys.float().repeat_interleave(g, dim=2)  # [B, n, H, D]
    v = values.float().repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bnhd->bhqn", q.float(), k) * q.shape[-1] ** -0.5
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqn,bnhd->bqhd", p, v).to(q.dtype)
