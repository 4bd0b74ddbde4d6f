"""A decoder block for one token (batch-1 decode) in one library call:

    one_token_block(x, position, rope, q_scale, attention, cache, moe, norms) -> bf16 [1, D], or None

    h = x + attention(rmsnorm(x) * norm1);  out = h + moe(rmsnorm(h) * norm2)

``attention`` is the layer's ``OneTokenAttention`` and ``cache`` the arguments it takes after the
token's (cache tensors, scales, chunk, ring); ``moe`` is ``(router_ED, w1, w3, w2, s1, s3, s2)`` as
``moe_one_token`` takes them; ``norms`` is ``(norm1, eps1, norm2, eps2)``, the two RMSNorms'
bf16 weights [D] and eps. The library (``llk_block_one_token``, kernels/csrc) runs the very
functions of the separate calls (``kernels.rmsnorm``, ``OneTokenAttention``, ``moe_one_token``)
and the core's residual adds (an fp32 sum rounded once to bf16), so the result has their bits.

Why: after each call that streams a layer's weights, the interpreter's code and data come back
from L3; a block's ~8 Python-level steps between its two big calls (the norms, the adds, the layers'
checks and returns) measured ~0.2 ms a block on a 2-core Xeon (a norm call 77 us there right after
a streaming write, 8.6 us in a loop). None (the caller takes the separate calls) wherever one of
the two one-call layers would decline, or a norm weight is not a contiguous bf16 vector of x's width.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from .attention_layer import OneTokenAttention, check_rc
from .cpu_lib import library
from .moe import LlkMoeBf16Plan, moe_plan


class LlkBlockPlan(ctypes.Structure):
    _fields_ = [
        ("attn", ctypes.c_void_p), ("moe", ctypes.c_void_p), ("moe_bf16", ctypes.c_int64),
        ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
        ("D", ctypes.c_int64), ("nthreads", ctypes.c_int64),
    ]  # fmt: skip


def _norm_ok(w: torch.Tensor, dim: int) -> bool:
    return w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.shape == (dim,) and w.stride(-1) == 1


def one_token_block(x: torch.Tensor, position: int, rope: Optional[tuple], q_scale: Optional[float],
                    attention: OneTokenAttention, cache: tuple, moe: tuple, norms: tuple) -> Optional[torch.Tensor]:  # fmt: skip
    norm1, eps1, norm2, eps2 = norms
    if x.dim() != 2 or not (_norm_ok(norm1, x.shape[-1]) and _norm_ok(norm2, x.shape[-1])):
        return None
    call = attention.call_args(x, rope, *cache)
    if call is None:
        return None
    plan, cos, sin = call
    mplan = moe_plan(x, *moe)  # x stands for the MoE's input: same shape, dtype and device
    if mplan is None:
        return None
    threads = torch.get_num_threads()
    key = (id(plan), id(mplan), norm1.data_ptr(), norm2.data_ptr(), eps1, eps2, threads)
    kept = attention.block_plans
    entry = kept.get(key)
    if entry is None:
        if len(kept) >= 8:
            kept.clear()
        bp = LlkBlockPlan(ctypes.addressof(plan), ctypes.addressof(mplan), isinstance(mplan, LlkMoeBf16Plan),
                          norm1.data_ptr(), norm2.data_ptr(), eps1, eps2, plan.D, threads)  # fmt: skip
        entry = kept[key] = (bp, plan, mplan, norm1, norm2)  # the plans and norms live as long as it
    bp = entry[0]
    out = torch.empty(1, plan.D, dtype=torch.bfloat16)
    rc = library("avx2").llk_block_one_token(ctypes.addressof(bp), x.data_ptr(), position, cos, sin,
                                             q_scale is not None, q_scale or 0.0, out.data_ptr())  # fmt: skip
    if rc == -2:
        raise RuntimeError("llk_block_one_token: a MoE GEMV rejected a layout that prepare() accepted")  # a bug
    check_rc(rc, plan, position, "llk_block_one_token")
    return out
