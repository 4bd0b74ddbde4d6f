"""A decode step's attention layer for one token (batch 1) in one library call:

    layer = OneTokenAttention(wq, wk, wv, wo, n_heads, n_kv_heads, head_dim, qk_norm_eps)
    layer(x, position, rope, q_scale, cache_k, cache_v, k_scale, v_scale, chunk, ring) -> bf16 [1, D], or None

x is the layer's normed input, bf16 [1, D]; wq / wk / wv / wo the layer's weights (``kernels.formats``
containers or bf16 tensors [N, K], as ``kernels.linear`` takes them); ``rope`` the core's (cos, sin)
for the position (fp32, ``head_dim`` values each; None: a layer without RoPE); ``qk_norm_eps`` the
eps of the heads' RMSNorm after RoPE (None: none); ``q_scale`` a float that multiplies q (the
temperature of global layers; None: none); the cache tensors as the core's KV cache holds them
([B, slots, Hkv, head_dim]) and its kind (``chunk`` / ``ring`` as in ``decode_step``). The result is wo's output
before any reduction across ranks.

The library (``llk_attention_one_token``, kernels/csrc) runs the three GEMVs, RoPE, the heads'
RMSNorm, the temperature scale, the cache write and attention of ``decode_step``, and the wo GEMV.
Numerics: the GEMVs, the norm and the attention are the very functions the separate calls run;
the glue has the core's operations and roundings, so the result has the bits of the separate
calls (tests/kernels/test_attention_layer.py).

Why: at batch 1 an attention layer is ~25 PyTorch operators and 6 kernel dispatches around its
four GEMVs, ~0.2 ms a layer of Python and small ops (each slower right after a GEMV has streamed
its weights). None (the caller takes that path) unless x is one bf16 row on a CPU, the kernel
backend may use the CPU libraries, the cap is not ``none``, the cache is bf16, and every weight has
a one-call GEMV (not for fp8 / nvfp4-quantized activations, which the library does not quantize).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import cpu
from .cpu import LlkGemvCall
from .cpu_lib import isa, library
from .dispatch import get_backend


class LlkLinearCall(ctypes.Structure):
    _fields_ = [("io", LlkGemvCall), ("bf16_fn", ctypes.c_void_p), ("w", ctypes.c_void_p), ("ldw", ctypes.c_int64),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64)]  # fmt: skip


class LlkAttnPlan(ctypes.Structure):
    _fields_ = [
        ("D", ctypes.c_int64), ("H", ctypes.c_int64), ("Hkv", ctypes.c_int64), ("hd", ctypes.c_int64),
        ("wq", LlkLinearCall), ("wk", LlkLinearCall), ("wv", LlkLinearCall), ("wo", LlkLinearCall),
        ("qk_norm", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("cache_k", ctypes.c_void_p), ("cache_v", ctypes.c_void_p), ("strides", ctypes.c_int64 * 6),
        ("slots", ctypes.c_int64), ("chunk", ctypes.c_int64), ("ring", ctypes.c_int64), ("nthreads", ctypes.c_int64),
    ]  # fmt: skip


def _linear_call(w, keep: list) -> Optional[tuple[LlkLinearCall, int, int]]:
    """(call, N, K) of the one-call GEMV of ``w`` at one row, or None where it has none."""
    if isinstance(w, torch.Tensor):
        gemv = cpu.one_call_gemv_bf16(w)
        if gemv is None:
            return None
        fn, weight, ldw, n, k = gemv
        keep.append(weight)
        call = LlkLinearCall(LlkGemvCall(), ctypes.cast(fn, ctypes.c_void_p).value, weight.data_ptr(), ldw, n, k)
        return call, n, k
    gemv = cpu.one_call_gemv(w)
    if gemv is None:
        return None
    args = gemv[1]
    if args.E != 1:  # a dense weight: one "expert"
        return None
    one_start, one_end = (ctypes.c_int64 * 1)(0), (ctypes.c_int64 * 1)(1)
    args.row_start, args.row_end = ctypes.addressof(one_start), ctypes.addressof(one_end)
    keep += [one_start, one_end]
    return LlkLinearCall(LlkGemvCall.of(gemv, keep)), args.N, args.K


class OneTokenAttention:
    """See the module docstring. Holds its weights; its C plans are built on first use per CPU
    path, thread count and cache."""

    def __init__(self, wq, wk, wv, wo, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm_eps: Optional[float]):
        self.weights = (wq, wk, wv, wo)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.qk_norm_eps = qk_norm_eps
        self._plans: dict = {}
        self.block_plans: dict = {}  # kernels.block_layer's plans (they point at this layer's)

    def _plan(self, cache_k: torch.Tensor, cache_v: torch.Tensor, chunk: int, ring: bool) -> Optional[tuple]:
        # not the cache tensors: a plan is found by their address, shape and strides, so it is only
        # ever used with a live cache at that very place (and an old cache is freed with its model)
        keep: list = []
        calls = [_linear_call(w, keep) for w in self.weights]
        if any(c is None for c in calls):
            return None
        (q, nq, d), (k, nk, dk), (v, nv, dv), (o, no, ko) = calls
        h, hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        # shapes as the separate calls would check them: x [D] -> q [H hd], k / v [Hkv hd] -> [D]
        if nq != h * hd or nk != hkv * hd or nv != hkv * hd or dk != d or dv != d or ko != nq or no != d:
            return None
        if hd % 8 or h % hkv or cache_k.shape[2:] != (hkv, hd) or cache_v.shape[:3] != cache_k.shape[:3]:
            return None
        if cache_k.stride(-1) != 1 or cache_v.stride(-1) != 1 or (ring and chunk <= 0):
            return None
        plan = LlkAttnPlan(d, h, hkv, hd, q, k, v, o, self.qk_norm_eps is not None, self.qk_norm_eps or 0.0, hd**-0.5,
                           cache_k.data_ptr(), cache_v.data_ptr(), (ctypes.c_int64 * 6)(*cache_k.stride()[:3],
                           *cache_v.stride()[:3]), cache_k.shape[1], chunk, ring,
                           torch.get_num_threads())  # fmt: skip
        plan.keep = keep  # whoever holds the plan (kernels.block_layer's plans too) holds what it points to
        return plan, keep

    def __call__(self, x: torch.Tensor, position: int, rope: Optional[tuple], q_scale: Optional[float],
                 cache_k: torch.Tensor, cache_v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                 chunk: int, ring: bool) -> Optional[torch.Tensor]:  # fmt: skip
        call = self.call_args(x, rope, cache_k, cache_v, k_scale, v_scale, chunk, ring)
        if call is None:
            return None
        plan, cos, sin = call
        out = torch.empty(1, plan.D, dtype=torch.bfloat16)
        rc = library("avx2").llk_attention_one_token(ctypes.addressof(plan), x.data_ptr(), position, cos, sin,
                                                     q_scale is not None, q_scale or 0.0, out.data_ptr())  # fmt: skip
        check_rc(rc, plan, position, "llk_attention_one_token")
        return out

    def call_args(self, x: torch.Tensor, rope: Optional[tuple], cache_k: torch.Tensor, cache_v: torch.Tensor,
                  k_scale: torch.Tensor, v_scale: torch.Tensor, chunk: int, ring: bool) -> Optional[tuple]:
        """(plan, cos pointer, sin pointer) of the library call for these arguments, or None where
        it does not apply (see the module docstring)."""
        if x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] != 1 or x.stride(-1) != 1:
            return None
        if cache_k.dtype != torch.bfloat16 or cache_v.dtype != torch.bfloat16 or k_scale.numel() or v_scale.numel():
            return None
        if get_backend() not in ("auto", "cpu") or cache_k.device.type != "cpu":
            return None
        path = isa()
        if path == "none":
            return None
        key = (path, torch.get_num_threads(), cache_k.data_ptr(), cache_v.data_ptr(), tuple(cache_k.shape),
               tuple(cache_v.shape), cache_k.stride(), cache_v.stride(), chunk, ring)  # fmt: skip
        entry = self._plans.get(key)
        if entry is None:
            if len(self._plans) >= 8:
                self._plans.clear()
            entry = self._plans[key] = self._plan(cache_k, cache_v, chunk, ring) or (None, None)
        plan = entry[0]
        if plan is None or x.shape[1] != plan.D:
            return None
        if rope is not None:
            cos, sin = rope
            if cos.dtype != torch.float32 or cos.numel() != plan.hd or not cos.is_contiguous() or not sin.is_contiguous():
                return None
            cos, sin = cos.data_ptr(), sin.data_ptr()
        else:
            cos = sin = None
        return plan, cos, sin


def check_rc(rc: int, plan: LlkAttnPlan, position: int, fn: str) -> None:
    """Raise for a non-zero return code of a library call that ran an attention plan."""
    if rc == -1:
        raise ValueError(f"position {position} lies outside this layer's KV cache of {plan.slots} slots")
    if rc:
        raise RuntimeError(f"{fn}: a GEMV rejected a layout that prepare() accepted ({rc})")  # a bug
