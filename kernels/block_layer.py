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

    plan_blocks(x, blocks) -> BlocksPlan or None;  run_blocks(plan, x, position, rope, q_scales) -> bf16 [1, D]

take every block of a decode step in one call (``llk_blocks_one_token``: the blocks'
``llk_block_one_token`` in turn, so the same bits): the plan is made once from the blocks' arguments
(the caller makes it again when they or ``state()`` change), and a step passes only the position,
RoPE and temperatures. With a call per block, each block's Python (its arguments, the plans' checks,
the call) still took ~0.1 ms right after its weights streamed through the caches: 1.6-2.1 ms of a
~21 ms int4_all step on the bench preset (2 Zen 5 cores).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from .attention_layer import LlkAttnPlan, OneTokenAttention, check_rc
from .cpu_lib import isa, library
from .dispatch import get_backend
from .moe import LlkMoeBf16Plan, moe_plan


class LlkBlockPlan(ctypes.Structure):
    _fields_ = [
        ("attn", ctypes.c_void_p), ("moe", ctypes.c_void_p), ("moe_bf16", ctypes.c_int64),
        ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
        ("D", ctypes.c_int64), ("nthreads", ctypes.c_int64),
    ]  # fmt: skip


def _norm_ok(w: torch.Tensor, dim: int) -> bool:
    return w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.shape == (dim,) and w.stride(-1) == 1


def _block_plan(x: torch.Tensor, rope: Optional[tuple], attention: OneTokenAttention, cache: tuple, moe: tuple,
                norms: tuple) -> Optional[tuple]:  # fmt: skip
    """(entry, cos pointer, sin pointer) of the library call for these arguments, or None where it
    does not apply: entry is (LlkBlockPlan, its attention plan, its MoE plan, the norm weights), kept
    in the attention layer's dict; holding it holds all that the block plan points to."""
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
    return entry, cos, sin


def _check_rc(rc: int, plan: LlkAttnPlan, position: int, fn: str) -> None:
    if rc == -2:
        raise RuntimeError(f"{fn}: a MoE GEMV rejected a layout that prepare() accepted")  # a bug
    check_rc(rc, plan, position, fn)


def one_token_block(x: torch.Tensor, position: int, rope: Optional[tuple], q_scale: Optional[float],
                    attention: OneTokenAttention, cache: tuple, moe: tuple, norms: tuple) -> Optional[torch.Tensor]:  # fmt: skip
    call = _block_plan(x, rope, attention, cache, moe, norms)
    if call is None:
        return None
    (bp, plan, *_), cos, sin = call
    out = torch.empty(1, bp.D, dtype=torch.bfloat16)
    rc = library("avx2").llk_block_one_token(ctypes.addressof(bp), x.data_ptr(), position, cos, sin,
                                             q_scale is not None, q_scale or 0.0, out.data_ptr())  # fmt: skip
    _check_rc(rc, plan, position, "llk_block_one_token")
    return out


def state() -> tuple:
    """What block plans depend on besides their arguments: threads, backend and CPU path now."""
    return torch.get_num_threads(), get_backend(), isa()


class BlocksPlan:
    """``plan_blocks``'s result: the blocks' library plans in order, and what they point to."""

    def __init__(self, n: int):
        self.n = n
        self.plans, self.rope = (ctypes.c_void_p * n)(), (ctypes.c_int8 * n)()
        self.use_q, self.q_scales = (ctypes.c_int8 * n)(), (ctypes.c_float * n)()
        self.entries: list[tuple] = []  # each block's (LlkBlockPlan, attention plan, MoE plan, norms): held
        self.d = 0  # the token's width
        self.rope_hd: Optional[int] = None  # the head size of the blocks with RoPE (None: no block has it)

    @property
    def blocks(self) -> list[LlkBlockPlan]:
        return [e[0] for e in self.entries]


def plan_blocks(x: torch.Tensor, blocks: list) -> Optional[BlocksPlan]:
    """A plan of several blocks in turn, each as ``one_token_block`` computes it, for ``run_blocks``:
    blocks is a list of ``(use_rope, attention, cache, moe, norms)`` (one_token_block's arguments,
    RoPE as a flag, no temperature). None where any block declines. The plan holds while these
    arguments and ``state()`` do (the caller keeps track)."""
    if not blocks:
        return None
    bp = BlocksPlan(len(blocks))
    for i, (use_rope, attention, cache, moe, norms) in enumerate(blocks):
        call = _block_plan(x, None, attention, cache, moe, norms)  # the step's RoPE is checked by run_blocks
        if call is None:
            return None
        entry = call[0]
        bp.entries.append(entry)
        bp.plans[i], bp.rope[i] = ctypes.addressof(entry[0]), use_rope
    bp.d = bp.entries[0][1].D
    hds = {e[1].hd for e, r in zip(bp.entries, bp.rope) if r}
    if len(hds) > 1:  # one RoPE for the step: no plan for layers of different head sizes
        return None
    bp.rope_hd = hds.pop() if hds else None
    return bp


def run_blocks(plan: BlocksPlan, x: torch.Tensor, position: int, rope: Optional[tuple],
               q_scales: list) -> Optional[torch.Tensor]:  # fmt: skip
    """The blocks of ``plan`` for the token x ([1, D] bf16) at ``position``: ``rope`` the (cos, sin) of
    the position for the blocks with RoPE, ``q_scales`` each block's temperature (a float or None).
    The last block's output, or None (nothing computed) where x or rope does not fit the plan."""
    d = plan.d
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.shape != (1, d) or x.stride(-1) != 1:
        return None
    cos = sin = None
    if plan.rope_hd is not None:
        cos, sin = rope
        if cos.dtype != torch.float32 or cos.numel() != plan.rope_hd or sin.numel() != cos.numel():
            return None
        if not cos.is_contiguous() or not sin.is_contiguous():
            return None
        cos, sin = cos.data_ptr(), sin.data_ptr()
    for i, q in enumerate(q_scales):
        plan.use_q[i], plan.q_scales[i] = q is not None, q or 0.0
    out = torch.empty(1, d, dtype=torch.bfloat16)
    failed = ctypes.c_int64(-1)
    rc = library("avx2").llk_blocks_one_token(plan.plans, plan.n, x.data_ptr(), position, cos, sin, plan.rope,
                                              plan.use_q, plan.q_scales, out.data_ptr(), ctypes.byref(failed))  # fmt: skip
    if rc:
        i = failed.value
        attn = plan.entries[i][1]
        if rc == -1:
            raise ValueError(f"block {i}: position {position} lies outside its layer's KV cache of {attn.slots} slots")
        _check_rc(rc, attn, position, f"llk_blocks_one_token (block {i})")
    return out
