"""Triton GEMMs for the quantized weight formats, dense and grouped by expert (MoE).

Public functions (CUDA tensors in production; CPU tensors under ``TRITON_INTERPRET=1`` in tests):

    linear(x [..., K], w) -> [..., N]
    grouped_linear(x [T, K], offsets [E + 1], w [E, N, ...]) -> [T, N]
    grouped_swiglu(x [T, K], offsets [E + 1], w1, w3, w2) -> [T, D]
    swiglu(x [..., K], w1, w3, w2) -> [..., D]  (dense: the shared expert)

``w`` is an ``Int4Weight``, ``Fp8Weight``, ``W4A8Weight`` or ``NVFP4Weight`` (``kernels.formats``);
``dequantize_weight`` there is the numerical definition every kernel here reproduces, with the
activation numerics of ``kernels.reference``. ``supports(w, device)`` says whether a format runs
on a device (e4m3 tensors need sm_89+); ``block_config(...)`` overrides tile sizes (tests, tuning).

Design
------
*One* GEMM kernel, ``_gemm_kernel``, with a constexpr ``FORMAT`` switch, rather than a kernel
family per format. The loop is the same for all four formats -- find the tile's expert and rows,
walk K, accumulate in fp32, scale in the epilogue, masked store -- and only two things differ:
how a packed weight tile becomes ``tl.dot`` operands (``_dot_weight_tile``) and which scales the
epilogue applies (``_epilogue``). Both are small ``@triton.jit`` helpers branching on constexprs,
so every format still compiles to its own specialised binary with no run-time branching, and a fix
to masking or the tile map lands once. Dense ``linear`` is the same kernel with one "expert".

Tiling. The grid is (m-tiles, n-tiles); consecutive programs share an n-tile, so the m-tiles
of one expert reuse its weight tile from L2. For grouped calls each program finds its rows from
``offsets`` itself: it loads the offsets as one vector, splits the rows into E + 2 segments (rows
before ``offsets[0]``, the E experts, rows after ``offsets[E]``), counts tiles per segment, and a
cumulative sum says which segment owns m-tile ``pid_m`` -- no host sync (CUDA-graph safe), no
extra launch, no per-expert launches; empty experts own no tile, and tiles of the two expert-less
segments write zeros (the reference's contract). The grid is sized by the upper bound
``min(T, cdiv(T, BLOCK_M) + E + 2)``; programs past the last real tile exit at once.

Weight decoding happens in registers, per K block:
  * int4 / w4a8: bytes hold k even (low nibble) and k odd (high nibble). Instead of interleaving
    the nibbles back into K order (a layout shuffle of the big operand), the *activation* tile
    is split into its even and odd columns (reshape + split, register-local) and two dots of
    depth BLOCK_K / 2 run against the low and high nibble tiles. Integers -8..7 are exact in
    bf16 and in e4m3, so the dot sees raw integers; the group scale multiplies the fp32 partial
    product of the K block (BLOCK_K divides the group size, so one scale per column per block).
    That keeps w4a16 exact up to fp32 accumulation (q * bf16 scale would round in bf16) and,
    for w4a8, lets both operands be fp8 for the Hopper fp8 tensor-core path, with a fp32
    promotion of the partial sum every K block.
  * fp8 rowwise: e4m3 weights go straight into the dot (fp8 x fp8 when the GPU has fp8 MMA,
    sm_89+; otherwise both upcast to bf16, which is exact).
  * nvfp4: e2m1 codes are decoded with bit math (code bits placed in an fp16 exponent/mantissa,
    times 2**14), multiplied by their e4m3 block scale (exact in bf16: 2 x 4 significant bits),
    and the per-tensor / per-expert global scale is divided out in the epilogue.
Epilogue: fp8 / w4a8 multiply by the per-token activation scale and the per-channel weight
scale; nvfp4 divides by the global scale(s); ``grouped_swiglu`` keeps two accumulators (W1 and
W3) fed by the same activation tile in the same K loop and writes ``silu(a1) * a3`` once.

Activation quantization is a separate small kernel per row (``_quant_fp8_rows_kernel``,
``_quant_nvfp4_rows_kernel``): the per-token fp8 scale needs the amax over all of K before the
first K block of the GEMM, which a GEMM tile does not have. Rounding to e4m3 / e2m1 is done with
explicit fp32 bit math (round to nearest even, saturating) so the result is the same on the GPU
and in Triton's interpreter (whose fp32 -> fp8 cast mis-rounds across binades); division is
``div_rn`` (IEEE), so both match ``kernels.reference`` bit for bit.

Interpreter (``TRITON_INTERPRET=1``, the CPU tests): it stores bf16 as raw uint16 and does no bf16
arithmetic (``tl.dot`` would multiply bit patterns) and its fp32 -> bf16 cast truncates, so there
bf16 operands are fed to the dot as fp32 (the same exact values) and bf16 outputs are written as
fp32 and rounded by torch. Only these launch-time constexprs differ from the GPU build.
"""

from contextlib import contextmanager
from dataclasses import dataclass, replace
import logging
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from triton.runtime.errors import OutOfResources

from .formats import Fp8Weight, Int4Weight, NVFP4Weight, W4A8Weight

log = logging.getLogger(__name__)

FMT_INT4: tl.constexpr = tl.constexpr(0)  # w4a16
FMT_FP8: tl.constexpr = tl.constexpr(1)  # fp8 rowwise, w8a8
FMT_W4A8: tl.constexpr = tl.constexpr(2)
FMT_NVFP4: tl.constexpr = tl.constexpr(3)

NVFP4_BLOCK = 16


# ----------------------------------------------------------------------------------------------
# rounding helpers (fp32 in, fp32 on the target grid out)


@triton.jit
def _round_to_e4m3(v):
    """Round to the nearest float8_e4m3fn value, ties to even, saturating at +-448."""
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    a = tl.abs(v)
    # normal range: keep 3 mantissa bits of the fp32 encoding, rounding half to even;
    # a carry out of the mantissa bumps the exponent, which is what we want.
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == ~0xFFFFF
    normal = bits.to(tl.float32, bitcast=True)
    # subnormal range (< 2**-6): fixed spacing 2**-9; adding 2**14 makes fp32's own rounding do it
    sub = (a + 16384.0) - 16384.0
    r = tl.minimum(tl.where(a < 0.015625, sub, normal), 448.0)
    return tl.where(v < 0, -r, r)


@triton.jit
def _round_to_e2m1(v):
    """Round to the nearest fp4 e2m1 value (0, .5, 1, 1.5, 2, 3, 4, 6), ties to even, clamp +-6."""
    a = tl.abs(v)
    r = tl.where(a <= 0.25, 0.0,
        tl.where(a < 0.75, 0.5,
        tl.where(a <= 1.25, 1.0,
        tl.where(a < 1.75, 1.5,
        tl.where(a <= 2.5, 2.0,
        tl.where(a < 3.5, 3.0,
        tl.where(a <= 5.0, 4.0, 6.0)))))))  # fmt: skip
    return tl.where(v < 0, -r, r)


@triton.jit
def _e2m1_value(code):
    """4-bit e2m1 code (sign, 2 exponent bits, 1 mantissa bit) -> its fp32 value.

    The same bits at the top of an fp16's exponent and mantissa make an fp16 equal to the value
    * 2**-14 (the subnormal 0.5 included), so no table lookup is needed.
    """
    c = code.to(tl.int16)
    return (((c & 8) << 12) | ((c & 7) << 9)).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


# ----------------------------------------------------------------------------------------------
# activation quantization


@triton.jit
def _quant_fp8_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, UB, BLOCK_K: tl.constexpr):
    """Per token: s = clamp(amax, max=UB, min=1e-12) / 448, q = e4m3(x / s)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    amax = tl.max(amax, axis=0)
    s = tl.math.div_rn(tl.maximum(tl.minimum(amax, UB), 1e-12), 448.0)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.math.div_rn(x, s))
        tl.store(q_ptr + row * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + row, s)


@triton.jit
def _quant_nvfp4_rows_kernel(
    x_ptr, out_ptr, g_ptr, offsets_ptr,
    K, stride_xm, stride_om, stride_g, E,
    GROUPED: tl.constexpr, E_POW2: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Dynamic nvfp4 activations with a static global scale g (per tensor, or per expert of the row).

    Writes x_deq * g = e2m1 * local_scale, exact in bf16; the GEMM epilogue divides by g.
    """
    row = tl.program_id(0)
    k_blk = tl.program_id(1)
    if GROUPED:  # the row's expert: how many experts end at or before it
        ex = tl.arange(0, E_POW2)
        ends = tl.load(offsets_ptr + 1 + ex, mask=ex < E, other=2**31 - 1)
        e = tl.sum((ends <= row).to(tl.int32), axis=0)
        e = tl.minimum(e, E - 1)  # rows past offsets[E] belong to nobody; keep the load in bounds
        g = tl.load(g_ptr + e * stride_g)
    else:
        g = tl.load(g_ptr)
    G: tl.constexpr = BLOCK_K // 16
    k = k_blk * BLOCK_K + tl.arange(0, G)[:, None] * 16 + tl.arange(0, 16)[None, :]
    row64 = row.to(tl.int64)
    x = tl.load(x_ptr + row64 * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    local = _round_to_e4m3(tl.math.div_rn(amax, 6.0) * g)
    scale = tl.math.div_rn(local, g)
    ok = scale > 0  # an all-zero block (or one whose scale underflows) quantizes to zeros
    v = tl.math.div_rn(x, tl.where(ok, scale, 1.0)[:, None])
    q = tl.where(ok[:, None], _round_to_e2m1(v), 0.0)
    tl.store(out_ptr + row64 * stride_om + k, (q * local[:, None]).to(out_ptr.dtype.element_ty), mask=k < K)


# ----------------------------------------------------------------------------------------------
# the GEMM


@triton.jit
def _dot_weight_tile(
    acc, a, w_ptr, s_ptr, offs_n, k0, N, K, stride_wn, stride_sn,
    FORMAT: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """acc += a[BLOCK_M, BLOCK_K] @ W[k0:k0+BLOCK_K, offs_n], W decoded from its packed form.

    ``w_ptr`` / ``s_ptr`` already point at this expert's weight and block scales.
    """
    n_ok = offs_n[None, :] < N
    if FORMAT == FMT_FP8:
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None], mask=n_ok & (k[:, None] < K), other=0.0)
        if DOT_DTYPE == tl.float8e4nv:
            # Hopper's fp8 MMA accumulates with reduced precision (Triton's default there is to
            # never promote); promote the running sum into a full fp32 accumulator once per K
            # block, as the 4-bit formats do explicitly
            acc = tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, w.to(DOT_DTYPE), acc, input_precision=PRECISION)
    else:
        # two 4-bit values per byte along K: split the activations into even / odd columns
        a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte index along K
        p = tl.load(w_ptr + offs_n[None, :] * stride_wn + kb[:, None], mask=n_ok & (kb[:, None] < K // 2), other=0)
        if FORMAT == FMT_NVFP4:
            # e4m3 scale of the 16-wide block holding byte kb (both nibbles share it)
            s_ptrs = s_ptr + offs_n[None, :] * stride_sn + (kb[:, None] * 2) // 16
            sc = tl.load(s_ptrs, mask=n_ok & (kb[:, None] < K // 2), other=0.0).to(tl.float32)
            w_lo = (_e2m1_value(p & 0xF) * sc).to(DOT_DTYPE)  # e2m1 * e4m3: exact in bf16 / fp16
            w_hi = (_e2m1_value(p >> 4) * sc).to(DOT_DTYPE)
            acc = tl.dot(a_even, w_lo, acc, input_precision=PRECISION)
            acc = tl.dot(a_odd, w_hi, acc, input_precision=PRECISION)
        else:
            # int4, two's complement: arithmetic shifts of the signed byte sign-extend each nibble
            p = p.to(tl.int8, bitcast=True)
            lo = ((p << 4) >> 4).to(tl.float16).to(DOT_DTYPE)  # |q| <= 8: exact in fp16, bf16 and e4m3
            hi = (p >> 4).to(tl.float16).to(DOT_DTYPE)
            part = tl.dot(a_even, lo, input_precision=PRECISION)
            part = tl.dot(a_odd, hi, part, input_precision=PRECISION)
            # BLOCK_K divides GROUP_SIZE: one group scale per column for the whole K block
            gs = tl.load(s_ptr + offs_n * stride_sn + k0 // GROUP_SIZE, mask=offs_n < N, other=0.0)
            acc += part * gs.to(tl.float32)[None, :]
    return acc


@triton.jit
def _epilogue(acc, a_scale, c_ptr, offs_n, N, FORMAT: tl.constexpr):
    """Scales applied once per output: per-token activation scale x per-channel weight scale
    (fp8, w4a8), or 1 / global scale (nvfp4). ``c_ptr`` points at this expert's scales."""
    if FORMAT == FMT_FP8 or FORMAT == FMT_W4A8:
        wc = tl.load(c_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = acc * a_scale[:, None] * wc[None, :]
    elif FORMAT == FMT_NVFP4:
        acc = acc / tl.load(c_ptr)
    return acc


@triton.jit
def _gemm_kernel(
    a_ptr, a_scale_ptr,  # activations [T, K] (x, fp8 or nvfp4-dequantized), per-token scale [T]
    w_ptr, s_ptr, c_ptr,  # weight [E, N, K or K/2], block scales [E, N, K/gs], epilogue scales
    w3_ptr, s3_ptr, c3_ptr,  # the W3 operands when SWIGLU
    out_ptr, offsets_ptr,
    M, N, K, E,
    stride_am, stride_om,
    stride_we, stride_wn, stride_se, stride_sn, stride_ce,
    stride_w3e, stride_w3n, stride_s3e, stride_s3n, stride_c3e,
    FORMAT: tl.constexpr, GROUPED: tl.constexpr, SWIGLU: tl.constexpr, GROUP_SIZE: tl.constexpr,
    S_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST_A: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)

    # --- which expert and rows this m-tile covers
    if GROUPED:
        # Row segments: [0, off[0]) with no expert, experts 0 .. E-1, then [off[E], M) with no
        # expert; segment s holds expert s - 1. Tiles are numbered segment after segment.
        seg_ids = tl.arange(0, S_POW2)
        starts = tl.load(offsets_ptr + seg_ids - 1, mask=(seg_ids >= 1) & (seg_ids <= E + 1), other=0)
        ends = tl.load(offsets_ptr + seg_ids, mask=seg_ids <= E, other=0)
        ends = tl.where(seg_ids == E + 1, M, ends)
        tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
        tiles_end = tl.cumsum(tiles, axis=0)
        seg = tl.sum((tiles_end <= pid_m).to(tl.int32), axis=0)  # segments whose tiles all come earlier
        if seg >= E + 2:  # padding of the grid's upper bound
            return
        mine = seg_ids == seg
        first_tile = tl.sum(tl.where(mine, tiles_end - tiles, 0), axis=0)
        row0 = tl.sum(tl.where(mine, starts, 0), axis=0) + (pid_m - first_tile) * BLOCK_M
        row_end = tl.sum(tl.where(mine, ends, 0), axis=0)
        if (seg == 0) | (seg == E + 1):  # rows no expert owns: zeros, as the reference returns
            rows = row0.to(tl.int64) + tl.arange(0, BLOCK_M)
            zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty)
            mask = (rows[:, None] < row_end) & (offs_n[None, :] < N)
            tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], zeros, mask=mask)
            return
        e = (seg - 1).to(tl.int64)  # e * stride may pass 2**31 (128 experts of 8192 x 5120 fp8)
    else:
        e = tl.full([], 0, tl.int64)
        row0 = pid_m * BLOCK_M
        row_end = M

    rows = row0.to(tl.int64) + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end

    w1 = w_ptr + e * stride_we
    s1 = s_ptr + e * stride_se
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SWIGLU:
        w3 = w3_ptr + e * stride_w3e
        s3 = s3_ptr + e * stride_s3e
        acc3 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :], mask=row_ok[:, None] & (k[None, :] < K), other=0.0)
        if UPCAST_A:
            a = a.to(DOT_DTYPE)
        acc1 = _dot_weight_tile(acc1, a, w1, s1, offs_n, k0, N, K, stride_wn, stride_sn,
                                FORMAT, GROUP_SIZE, BLOCK_M, BLOCK_K, DOT_DTYPE, PRECISION)  # fmt: skip
        if SWIGLU:
            acc3 = _dot_weight_tile(acc3, a, w3, s3, offs_n, k0, N, K, stride_w3n, stride_s3n,
                                    FORMAT, GROUP_SIZE, BLOCK_M, BLOCK_K, DOT_DTYPE, PRECISION)  # fmt: skip

    a_scale = tl.zeros([BLOCK_M], dtype=tl.float32)
    if FORMAT == FMT_FP8 or FORMAT == FMT_W4A8:
        a_scale = tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)
    acc1 = _epilogue(acc1, a_scale, c_ptr + e * stride_ce, offs_n, N, FORMAT)
    if SWIGLU:
        acc3 = _epilogue(acc3, a_scale, c3_ptr + e * stride_c3e, offs_n, N, FORMAT)
        acc1 = acc1 * tl.sigmoid(acc1) * acc3

    out = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc1.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


# ----------------------------------------------------------------------------------------------
# launch configuration


@dataclass(frozen=True)
class BlockConfig:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int = 4
    num_stages: int = 3


_override: Optional[dict] = None


@contextmanager
def block_config(fp8_dot: Optional[bool] = None, **sizes):
    """Force block sizes (and/or the fp8-operand dot) for every launch inside the block.

    For tests (tiny blocks keep the interpreter fast) and for tuning sweeps in the benchmark.
    """
    global _override
    saved = _override
    _override = {"fp8_dot": fp8_dot, **sizes}
    try:
        yield
    finally:
        _override = saved


def _pick_config(fmt: int, rows_per_expert: int, n: int) -> BlockConfig:
    """Heuristic tiles (first guesses, to be tuned on the GPU with scripts/bench_triton.py).

    Decode (few rows): the weight stream is everything, so small BLOCK_M and a narrow BLOCK_N
    that yields >= 1 program per SM, deep pipelining. Prefill: square-ish tiles.
    """
    if rows_per_expert <= 16:
        cfg = BlockConfig(16, 32 if n >= 4096 else 16, 128, num_warps=4, num_stages=4)
    elif rows_per_expert <= 64:
        cfg = BlockConfig(64, 64, 128, num_warps=4, num_stages=4)
    else:
        # bf16 operands (int4, nvfp4) take twice the shared memory of fp8 ones per K element
        cfg = BlockConfig(128, 128, 64 if fmt in (0, 3) else 128, num_warps=8, num_stages=3)
    if _override:
        cfg = replace(cfg, **{k: v for k, v in _override.items() if k != "fp8_dot" and v is not None})
    return cfg


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_fp8_dot_broken = False  # set if the compiler rejected an fp8 x fp8 dot once; we then upcast


def supports(w, device: torch.device) -> bool:
    """Whether these kernels can run ``w``'s format on ``device``.

    Everything but int4 handles e4m3 tensors (weights, activations or scales), which Triton
    only accepts on sm_89+ (Ada, Hopper, Blackwell); the interpreter runs all formats.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return _interpreting()
    return isinstance(w, Int4Weight) or torch.cuda.get_device_capability(device) >= (8, 9)


def _check_supported(w, device: torch.device) -> None:
    if not supports(w, device):
        raise NotImplementedError(
            f"the Triton {type(w).__name__} kernel needs float8_e4m3fn support (sm_89 or newer, or "
            f"TRITON_INTERPRET=1 on CPU); use the reference path on {device}"
        )


def _use_fp8_dot(device: torch.device) -> bool:
    if _override and _override.get("fp8_dot") is not None:
        return _override["fp8_dot"]
    if device.type != "cuda" or _interpreting() or _fp8_dot_broken:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)  # Ada / Hopper / Blackwell fp8 MMA


_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


# ----------------------------------------------------------------------------------------------
# host side: operands of one weight


@dataclass
class _Operands:
    fmt: int
    w: torch.Tensor  # [E, N, K or K/2], last dim contiguous
    s: torch.Tensor  # block scales [E, N, K/gs] (fp8 rowwise: unused, = c)
    c: torch.Tensor  # epilogue scales: [E, N] (fp8, w4a8), [E] (nvfp4 global), unused for int4
    group_size: int
    n: int
    k: int
    e: int


def _leading(t: torch.Tensor, ndim: int, e: Optional[int]) -> torch.Tensor:
    """View ``t`` with exactly one leading expert dim (size 1 for a dense weight)."""
    if t.dim() == ndim:
        t = t.unsqueeze(0)
    if t.dim() != ndim + 1 or (e is not None and t.shape[0] != e):
        raise ValueError(f"unexpected weight tensor shape {tuple(t.shape)}")
    return t if t.stride(-1) == 1 else t.contiguous()


def _operands(w) -> _Operands:
    return _validate(_unpack(w))


def _unpack(w) -> _Operands:
    if isinstance(w, Int4Weight):
        q = _leading(w.qweight, 2, None)
        s = _leading(w.scales, 2, q.shape[0])
        return _Operands(0, q, s, s, w.group_size, q.shape[1], q.shape[2] * 2, q.shape[0])
    if isinstance(w, Fp8Weight):
        q = _leading(w.weight, 2, None)
        c = _leading(w.scale.float(), 1, q.shape[0])
        return _Operands(1, q, c, c, 1, q.shape[1], q.shape[2], q.shape[0])
    if isinstance(w, W4A8Weight):
        q = _leading(w.qweight, 2, None)
        s = _leading(w.group_scales, 2, q.shape[0])
        c = _leading(w.channel_scales.float(), 1, q.shape[0])
        return _Operands(2, q, s, c, w.group_size, q.shape[1], q.shape[2] * 2, q.shape[0])
    if isinstance(w, NVFP4Weight):
        q = _leading(w.qweight, 2, None)
        s = _leading(w.scales, 2, q.shape[0])
        g = w.global_scale.float()
        if w.input_global_scale is not None:
            g = g * w.input_global_scale.float()  # x_deq * g_in and W_deq * g_w go into the dot
        c = g.reshape(-1) if g.dim() else g.reshape(1).expand(q.shape[0])
        return _Operands(3, q, s, c, NVFP4_BLOCK, q.shape[1], q.shape[2] * 2, q.shape[0])
    raise TypeError(f"not a quantized weight: {type(w).__name__}")


def _validate(op: _Operands) -> _Operands:
    if op.k % op.group_size or (op.fmt != FMT_FP8 and op.s.shape[-1] != op.k // op.group_size):
        raise ValueError(
            f"K={op.k} must be a multiple of the group size {op.group_size}, with one scale per group "
            f"(scales have {op.s.shape[-1]} per row)"
        )
    if op.s.shape[:2] != op.w.shape[:2] or op.c.shape[0] != op.e:
        raise ValueError("weight and scale shapes disagree")
    return op


def _check_grouped(op: _Operands, grouped: bool, what: str) -> None:
    if not grouped and op.e != 1:
        raise ValueError(f"{what}: linear() takes a 2-D weight; use grouped_linear for [E, N, K] weights")


def _quantize_activations(x: torch.Tensor, w, offsets: Optional[torch.Tensor]):
    """Activation operand and per-token scale for the GEMM, as the format prescribes."""
    if isinstance(w, (Fp8Weight, W4A8Weight)):
        t, k = x.shape
        xq = torch.empty((t, k), dtype=torch.float8_e4m3fn, device=x.device)
        xs = torch.empty((t,), dtype=torch.float32, device=x.device)
        if t:
            _quant_fp8_rows_kernel[(t,)](
                x, xq, xs, k, x.stride(0), xq.stride(0), float(w.activation_scale_ub),
                BLOCK_K=min(triton.next_power_of_2(k), 1024 if not _interpreting() else 256),
            )  # fmt: skip
        return xq, xs
    if isinstance(w, NVFP4Weight) and w.input_global_scale is not None:
        t, k = x.shape
        g = w.input_global_scale.float()
        xa = torch.empty((t, k), dtype=torch.bfloat16, device=x.device)
        grouped = offsets is not None and g.dim() == 1
        e = g.numel()
        block = 256  # 16 scale blocks per program
        if t:
            _quant_nvfp4_rows_kernel[(t, triton.cdiv(k, block))](
                x, xa, g, offsets if grouped else g,
                k, x.stride(0), xa.stride(0), g.stride(0) if g.dim() else 0, e,
                GROUPED=grouped, E_POW2=triton.next_power_of_2(e), BLOCK_K=block,
            )  # fmt: skip
        return xa, xa  # second one: unused scale pointer
    return x, x


def _launch_gemm(a, a_scale, op: _Operands, op3: Optional[_Operands], out, offsets, grouped: bool):
    global _fp8_dot_broken
    t, k = a.shape
    if t == 0 or op.n == 0:
        return out
    fmt = op.fmt
    rows_hint = t if not grouped else max(1, t // op.e)
    cfg = _pick_config(fmt, rows_hint, op.n)
    block_k = cfg.BLOCK_K
    if fmt in (0, 2):
        block_k = min(block_k, op.group_size)
        if op.group_size % block_k:
            raise ValueError(f"BLOCK_K={block_k} must divide the group size {op.group_size}")
    if fmt != 1 and block_k < 32:
        raise ValueError("4-bit formats need BLOCK_K >= 32 (two dots of depth BLOCK_K / 2 >= 16)")
    # every tile holds >= 1 row, and each of the E + 2 row segments adds at most one partial tile
    grid_m = min(t, triton.cdiv(t, cfg.BLOCK_M) + op.e + 2) if grouped else triton.cdiv(t, cfg.BLOCK_M)
    grid = (grid_m, triton.cdiv(op.n, cfg.BLOCK_N))

    fp8_a = a.dtype == torch.float8_e4m3fn
    fp8_dot = fp8_a and _use_fp8_dot(a.device)
    if fp8_dot:
        dot_dtype = tl.float8e4nv
    elif fp8_a:
        dot_dtype = tl.bfloat16
    else:
        dot_dtype = _TL_DTYPE[a.dtype]
    if dot_dtype == tl.bfloat16 and _interpreting():
        # The interpreter stores bf16 as raw uint16 and cannot do arithmetic on it (tl.dot
        # multiplies bit patterns); fp32 holds the same exact operand values.
        dot_dtype = tl.float32
    a_tl = tl.float8e4nv if fp8_a else _TL_DTYPE[a.dtype]
    result = out
    if out.dtype == torch.bfloat16 and _interpreting():
        out = torch.empty_like(out, dtype=torch.float32)  # the interpreter's fp32 -> bf16 cast truncates
    o3 = op3 or op
    args = (
        a, a_scale, op.w, op.s, op.c, o3.w, o3.s, o3.c, out, offsets if grouped else a,
        t, op.n, k, op.e,
        a.stride(0), out.stride(0),
        op.w.stride(0), op.w.stride(1), op.s.stride(0), op.s.stride(1), op.c.stride(0),
        o3.w.stride(0), o3.w.stride(1), o3.s.stride(0), o3.s.stride(1), o3.c.stride(0),
    )  # fmt: skip
    meta = dict(
        FORMAT=fmt, GROUPED=grouped, SWIGLU=op3 is not None, GROUP_SIZE=op.group_size,
        S_POW2=triton.next_power_of_2(op.e + 2), BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=block_k,
        UPCAST_A=a_tl != dot_dtype, DOT_DTYPE=dot_dtype,
        PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    while True:
        try:
            _gemm_kernel[grid](*args, **meta)
            break
        except OutOfResources:  # shared memory of smaller GPUs (e.g. sm_89's ~100 KB): fewer stages
            if meta["num_stages"] <= 1:
                raise
            meta["num_stages"] -= 1
        except Exception as err:  # compiler / ptxas rejections; only the fp8-operand dot has a fallback
            if meta["DOT_DTYPE"] != tl.float8e4nv or (_override and _override.get("fp8_dot")):
                raise
            _fp8_dot_broken = True
            log.warning("fp8 x fp8 tl.dot failed to compile (%s); upcasting fp8 operands to bf16", err)
            meta.update(UPCAST_A=True, DOT_DTYPE=tl.bfloat16)
    if result is not out:
        result.copy_(out)
    return result


def _as_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"activations have {x.shape[-1]} features, the weight expects {k}")
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _as_offsets(offsets: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The kernels read offsets themselves (no host sync); they must sit on x's device."""
    return offsets.to(device=device).contiguous()


# ----------------------------------------------------------------------------------------------
# public API


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x [..., K] @ W.T for a 2-D quantized weight ``w`` [N, K]; output [..., N] in x.dtype."""
    _check_supported(w, x.device)
    op = _operands(w)
    _check_grouped(op, False, "linear")
    a = _as_rows(x, op.k)
    out = torch.empty((a.shape[0], op.n), dtype=x.dtype, device=x.device)
    aq, a_scale = _quantize_activations(a, w, None)
    _launch_gemm(aq, a_scale, op, None, out, None, grouped=False)
    return out.reshape(*x.shape[:-1], op.n)


def grouped_linear(x: torch.Tensor, offsets: torch.Tensor, w) -> torch.Tensor:
    """Rows offsets[e]:offsets[e+1] of x [T, K] times expert e's W.T; one launch for all experts.

    Rows outside offsets[0]:offsets[E] are zero (as in ``kernels.reference``).
    """
    _check_supported(w, x.device)
    op = _operands(w)
    if offsets.numel() != op.e + 1:
        raise ValueError(f"offsets has {offsets.numel()} entries; the weight has {op.e} experts")
    offsets = _as_offsets(offsets, x.device)
    a = _as_rows(x, op.k)
    out = torch.empty((a.shape[0], op.n), dtype=x.dtype, device=x.device)
    aq, a_scale = _quantize_activations(a, w, offsets)
    _launch_gemm(aq, a_scale, op, None, out, offsets, grouped=True)
    return out


def _same_activation_quant(w1, w3) -> bool:
    """Can W1 and W3 share one quantized activation tile?"""
    if type(w1) is not type(w3):
        return False
    if isinstance(w1, (Fp8Weight, W4A8Weight)):
        return w1.activation_scale_ub == w3.activation_scale_ub
    if isinstance(w1, NVFP4Weight):
        g1, g3 = w1.input_global_scale, w3.input_global_scale
        if g1 is None or g3 is None:
            return g1 is None and g3 is None
        # a shared calibration tensor is the common case; otherwise compare values (one sync)
        return g1.data_ptr() == g3.data_ptr() or (g1.shape == g3.shape and bool(torch.equal(g1, g3)))
    return True


def _swiglu_hidden(x: torch.Tensor, offsets: Optional[torch.Tensor], w1, w3) -> torch.Tensor:
    """silu(x W1.T) * (x W3.T) [T, N] from fp32 products, rounded once to x's dtype (as the reference).

    W1 and W3 run fused in one kernel (shared activation tile, two accumulators, SwiGLU in the
    epilogue) when they quantize the activations alike; otherwise two GEMMs write fp32 products."""
    for w in (w1, w3):
        _check_supported(w, x.device)
    grouped = offsets is not None
    op1 = _operands(w1)
    op3 = _operands(w3)
    a = _as_rows(x, op1.k)
    if (op1.n, op1.k, op1.e, op1.fmt, op1.group_size) != (op3.n, op3.k, op3.e, op3.fmt, op3.group_size):
        raise ValueError("w1 and w3 must have the same format and shape")
    if grouped and offsets.numel() != op1.e + 1:
        raise ValueError(f"offsets has {offsets.numel()} entries; the weights have {op1.e} experts")
    _check_grouped(op1, grouped, "swiglu")
    if _same_activation_quant(w1, w3):
        h = torch.empty((a.shape[0], op1.n), dtype=a.dtype, device=a.device)
        aq, a_scale = _quantize_activations(a, w1, offsets)
        return _launch_gemm(aq, a_scale, op1, op3, h, offsets, grouped=grouped)
    h1, h3 = (torch.empty((a.shape[0], op1.n), dtype=torch.float32, device=a.device) for _ in range(2))
    for w, op, h in ((w1, op1, h1), (w3, op3, h3)):
        aq, a_scale = _quantize_activations(a, w, offsets)
        _launch_gemm(aq, a_scale, op, None, h, offsets, grouped=grouped)
    return (torch.nn.functional.silu(h1) * h3).to(a.dtype)


def grouped_swiglu(x: torch.Tensor, offsets: torch.Tensor, w1, w3, w2) -> torch.Tensor:
    """Per expert: (silu(x W1.T) * (x W3.T)) W2.T; W2 is a second grouped GEMM."""
    offsets = _as_offsets(offsets, x.device)
    return grouped_linear(_swiglu_hidden(x, offsets, w1, w3), offsets, w2)


def swiglu(x: torch.Tensor, w1, w3, w2) -> torch.Tensor:
    """Dense SwiGLU FFN (the shared expert): (silu(x W1.T) * (x W3.T)) W2.T -> [..., D], with the
    fused W1 / W3 kernel of ``grouped_swiglu`` (the hidden activations never round before SwiGLU)."""
    out = linear(_swiglu_hidden(x, None, w1, w3), w2)
    return out.reshape(*x.shape[:-1], out.shape[-1])


__all__ = ["linear", "grouped_linear", "grouped_swiglu", "swiglu", "supports", "block_config", "BlockConfig"]
