"""A MoE layer for one token with top-1 routing (decode at batch 1) in one library call:

    moe_one_token(x, router_ED, w1, w3, w2, s1, s3, s2) -> bf16 [1, D], or None where it does not apply

``router_ED`` is the router as fp32 [E, D]; w1 / w3 / w2 the routed experts' weights, s1 / s3 / s2
the shared expert's (``kernels.formats`` containers). The library routes the token (the first
expert of the largest bf16 logit, its score sigmoid(logit)), runs the routed SwiGLU on x * score
and the shared SwiGLU on x with the same bf16-in, bf16-out GEMVs that ``kernels.grouped_swiglu``
and ``kernels.swiglu`` call at decode, and adds the two (``llk_moe_one_token``, kernels/csrc).

With bf16 weights (all six contiguous bf16 tensors: w1 / w3 [E, F, D], w2 [E, D, F], s1 / s3
[Fs, D], s2 [D, Fs], the quantized loader's ``KernelExperts`` and ``KernelFeedForward``) each
SwiGLU is the core's bf16 one, every product by the GEMV ``kernels.linear`` uses, silu and the
product rounded to bf16 as PyTorch rounds them (``llk_moe_one_token_bf16``).

Numerics: the GEMVs' bits are those of the separate calls; routing, score, scaled input and sum are
PyTorch's operations on the same values (one rounding to bf16 each), except that the router's fp32
sums are this kernel's order: a logit on a bf16 rounding tie can come out one ulp apart, which can
move the score by one ulp (and, where two experts' logits tie, the choice).

Why: at batch 1 a MoE layer is ~15 PyTorch operators and ~6 kernel dispatches around its four
GEMVs, each slower right after a GEMV has streamed its weights. None (the caller takes that path)
unless x is one bf16 row on a CPU, the kernel backend may use the CPU libraries, the CPU cap is
not ``none``, and every weight has a one-call GEMV there (not for fp8 / nvfp4-quantized
activations, which the library does not quantize in this call).
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Optional

import torch

from . import cpu
from .cpu import LlkGemvCall
from .cpu_lib import isa, library
from .dispatch import get_backend

class LlkMoePlan(ctypes.Structure):
    _fields_ = [
        ("E", ctypes.c_int64), ("D", ctypes.c_int64), ("F_routed", ctypes.c_int64), ("F_shared", ctypes.c_int64),
        ("router", ctypes.c_void_p), ("row_start", ctypes.c_void_p), ("row_end", ctypes.c_void_p),
        ("routed13", LlkGemvCall), ("routed2", LlkGemvCall), ("shared13", LlkGemvCall), ("shared2", LlkGemvCall),
    ]  # fmt: skip


def _plan(router_ED: torch.Tensor, w1, w3, w2, s1, s3, s2) -> Optional[tuple]:
    """(plan, what it points to) for these weights, or None where a GEMV has no one-call form."""
    calls = [cpu.one_call_gemv(w1, w3), cpu.one_call_gemv(w2), cpu.one_call_gemv(s1, s3), cpu.one_call_gemv(s2)]
    if any(c is None for c in calls):
        return None
    (_, a13, _), (_, a2, _), (_, b13, _), (_, b2, _) = calls
    e, d = router_ED.shape
    # shapes as the separate calls would check them: x [D] -> h [F] -> [D], for both SwiGLUs
    if a13.E != e or a2.E != e or a13.K != d or a2.K != a13.N or a2.N != d or b13.K != d or b2.K != b13.N or b2.N != d:
        return None
    starts, ends = (ctypes.c_int64 * e)(), (ctypes.c_int64 * e)()  # the routed calls' rows: set by the library
    for a in (a13, a2):
        a.row_start, a.row_end = ctypes.addressof(starts), ctypes.addressof(ends)
    one_start, one_end = (ctypes.c_int64 * 1)(0), (ctypes.c_int64 * 1)(1)  # the shared calls': the one row
    for a in (b13, b2):
        a.row_start, a.row_end = ctypes.addressof(one_start), ctypes.addressof(one_end)
    keep = [router_ED, starts, ends, one_start, one_end, s1, s3, s2]  # (the shared weights' ids are in the key)
    plan = LlkMoePlan(e, d, a13.N, b13.N, router_ED.data_ptr(), ctypes.addressof(starts), ctypes.addressof(ends),
                      *(LlkGemvCall.of(c, keep) for c in calls))  # fmt: skip
    plan.keep = keep  # whoever holds the plan (kernels.block_layer's plans too) holds what it points to
    return plan, keep


class LlkMoeBf16Plan(ctypes.Structure):
    _fields_ = [
        ("E", ctypes.c_int64), ("D", ctypes.c_int64), ("F_routed", ctypes.c_int64), ("F_shared", ctypes.c_int64),
        ("router", ctypes.c_void_p), ("w1", ctypes.c_void_p), ("w3", ctypes.c_void_p), ("w2", ctypes.c_void_p),
        ("s1", ctypes.c_void_p), ("s3", ctypes.c_void_p), ("s2", ctypes.c_void_p), ("gemv", ctypes.c_void_p),
        ("nthreads", ctypes.c_int64),
    ]  # fmt: skip


# bf16 weights have no prepared forms to keep plans in: id(routed W1) -> {key: (plan, what it points
# to)}, dropped when that weight is (a WeakKeyDictionary would compare tensors with ==)
_BF16_PLANS: dict[int, dict] = {}


def _bf16_plans(w1: torch.Tensor) -> dict:
    kept = _BF16_PLANS.get(id(w1))
    if kept is None:
        kept = _BF16_PLANS[id(w1)] = {}
        weakref.finalize(w1, _BF16_PLANS.pop, id(w1), None)
    return kept


def _bf16_plan(router_ED: torch.Tensor, w1, w3, w2, s1, s3, s2) -> Optional[tuple]:
    ws = (w1, w3, w2, s1, s3, s2)
    if not all(isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.is_contiguous() for w in ws):
        return None
    gemv = cpu.one_call_gemv_bf16(s1)
    if w1.dim() != 3 or gemv is None:
        return None
    (e, f, d), fs = w1.shape, s1.shape[0]
    if router_ED.shape != (e, d) or w3.shape != (e, f, d) or w2.shape != (e, d, f):
        return None
    if s3.shape != (fs, d) or s2.shape != (d, fs):
        return None
    fn = ctypes.cast(gemv[0], ctypes.c_void_p).value
    plan = LlkMoeBf16Plan(e, d, f, fs, router_ED.data_ptr(), *(w.data_ptr() for w in ws), fn,
                          torch.get_num_threads())  # fmt: skip
    plan.keep = [router_ED, *ws[1:]]  # not w1: it keys the plan (a strong reference would keep it forever)
    return plan, plan.keep


def _moe_bf16_plan(x: torch.Tensor, router_ED: torch.Tensor, path: str, ws: tuple) -> Optional[LlkMoeBf16Plan]:
    key = (path, torch.get_num_threads(), router_ED.data_ptr(), tuple(router_ED.shape), ws[0].data_ptr(),
           *(id(w) for w in ws[1:]))  # fmt: skip
    kept = _bf16_plans(ws[0])
    entry = kept.get(key)
    if entry is None:
        if len(kept) >= 8:
            kept.clear()
        entry = kept[key] = _bf16_plan(router_ED, *ws) or (None, None)
    plan = entry[0]
    return None if plan is None or x.shape[1] != plan.D else plan


def moe_one_token(x: torch.Tensor, router_ED: torch.Tensor, w1, w3, w2, s1, s3, s2) -> Optional[torch.Tensor]:
    plan = moe_plan(x, router_ED, w1, w3, w2, s1, s3, s2)
    if plan is None:
        return None
    out = torch.empty(1, plan.D, dtype=torch.bfloat16)
    if isinstance(plan, LlkMoeBf16Plan):
        library("avx2").llk_moe_one_token_bf16(ctypes.addressof(plan), x.data_ptr(), out.data_ptr(), None)
        return out
    rc = library("avx2").llk_moe_one_token(ctypes.addressof(plan), x.data_ptr(), out.data_ptr(), None)
    if rc:
        raise RuntimeError(f"llk_moe_one_token: a GEMV rejected a layout that prepare() accepted ({rc})")  # a bug
    return out


def moe_plan(x: torch.Tensor, router_ED: torch.Tensor, w1, w3, w2, s1, s3, s2):
    """The library plan (LlkMoePlan, or LlkMoeBf16Plan for bf16 weights) of ``moe_one_token`` for these
    arguments, or None where it does not apply."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] != 1 or x.stride(-1) != 1:
        return None
    if get_backend() not in ("auto", "cpu") or router_ED.dtype != torch.float32 or not router_ED.is_contiguous():
        return None
    path = isa()
    if path == "none":
        return None
    if isinstance(w1, torch.Tensor):
        return _moe_bf16_plan(x, router_ED, path, (w1, w3, w2, s1, s3, s2))
    # one plan per (path, threads, router copy, shared weights), kept in the routed W1's prepared forms
    key = (path, torch.get_num_threads(), router_ED.data_ptr(), tuple(router_ED.shape), id(s1), id(s3), id(s2))
    kept = w1.prepared.setdefault("moe_one_token", {})
    entry = kept.get(key)
    if entry is None:
        if len(kept) >= 8:
            kept.clear()
        entry = kept[key] = _plan(router_ED, w1, w3, w2, s1, s3, s2) or (None, None)
    plan = entry[0]
    return None if plan is None or x.shape[1] != plan.D else plan
