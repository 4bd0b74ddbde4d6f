"""CPU fast paths: small C++ libraries (kernels/csrc) driven through ctypes, one per instruction set.

Paths, best first; ``LLAMA_LITE_CPU_ISA=amx|avx512|avx2|none`` (or ``set_isa``) caps the choice,
the default is the best this CPU has, and a cap above what the CPU has is refused:

* ``amx`` (Intel Sapphire Rapids and later; ``llk.cpp``): decode (a few rows per expert) through
  ``llk_gemv``, weights decoded to fp32 in registers (table lookups, group scale folded into the
  table) into fp32 FMAs; more rows through ``llk_amx``: 32 weight rows x 128-256 K values decoded
  to bf16 (exact for every format) into an L1 buffer and multiplied on AMX with fp32
  accumulation; int4's group scales, not exact in bf16, are applied to each group's fp32 sum.
* ``avx512`` (AVX-512 with BF16, VBMI and VNNI, no AMX: AMD Zen 4/5, Intel Cooper Lake; ``llk.cpp``): the same
  GEMV for fp32 activations; bf16 (and fp8 / nvfp4-quantized) activations through ``llk_gemv_dp``:
  weights decoded to bf16, exactly, for vdpbf16ps with fp32 sums (``GEMV_DOT``); more rows of such
  activations through ``llk_dpgemm``: ``llk_amx``'s decoder, activation tiles and group-scale
  flushes, with vdpbf16ps in zmm registers in place of tiles; more rows of fp32 activations: fp32
  weight tiles from the AVX2 library and PyTorch's fp32 GEMM.
* ``avx2`` (AVX2 + FMA + F16C: most laptops, AMD Zen 1-3; ``llk_avx2.cpp``): a GEMV of the same
  numerics built from 256-bit shuffles and FMAs; more rows: its fp32 weight tiles and PyTorch's
  fp32 GEMM.
* ``none`` (no compiler, ARM64, or asked for): PyTorch only. int4 with few rows through PyTorch's
  packed int4 kernel (``_weight_int4pack_mm_for_cpu``: its bf16 form where the result is rounded
  to bf16 anyway, else its fp32 form); everything else dequantized to fp32 one expert tile at a
  time (``TORCH_TILE_N`` rows, never a whole weight) for an fp32 GEMM.

Why C at all: decode is bound by reading the weights once, and PyTorch has no CPU kernel that
reads fp8 / w4a8 / nvfp4 weights at memory speed (``torch._scaled_mm`` on CPU takes ~400 ms for a
4096 x 4096 GEMV); its bf16 ``torch.mv`` reads at ~10 GB/s on AMD EPYC where a plain streaming read
gets ~50, so bf16 layers (attention, output, mode none) use the libraries' bf16 GEMV too.

int4 weights with ``int8_activations`` (an explicit option, kernels/formats.py): a few rows per
expert through an integer GEMV (``llk_gemv_q8``: the AVX-512 library's, VNNI in zmm registers, on
``amx`` and ``avx512`` where K and the group size are multiples of 128, else the AVX2 library's),
which quantizes the activations per 32 values exactly as the reference does; more rows on ``amx``
through ``llk_amx_q8``: the same quantization, int4 weights widened to int8 tiles and multiplied
with TDPBSSD, each 32-value block's exact int32 sum read out and scaled in fp32 (the GEMV's
numerics); on ``avx512`` through ``llk_dpq8``, the same with vpdpbusd in zmm registers; on
``avx2`` more rows multiply the reference's dequantized int8 activations (exact fp32 values)
through the paths above.

Numerics, on every path (vs kernels/reference.py): products are exact or rounded once in fp32
(q * s as the reference, or exact weight values times the activations) and sums are fp32, so
results differ from the reference by fp32 summation order only. Activation quantization (fp8 per
token, nvfp4 per 16) is bit-identical to the reference's. On the amx path an fp32 / fp16 input is
split into three bf16 rows whose sum is exactly the input (``_split_bf16``), so its products are exact too.

Weights are used exactly as stored (no repacked copy: no extra memory); ``prepare`` caches only
small things (scales in the dtype the kernel reads, per-expert factors, the C argument block),
per path. The activations are permuted to the order in which a library decodes weights, once per
call. Each library is built once per (source, compiler, flags) into a user cache dir with g++
(~10 s, no torch headers).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import torch
import torch.nn.functional as F

from . import reference
from .cpu_lib import (
    ISAS,
    S_BF16,
    S_E4M3,
    S_F32,
    S_NONE,
    W_FP4,
    W_FP8,
    W_INT4,
    LlkArgs,
    LlkWeight,
    amx_available,
    available,
    cpu_isas,
    gemv_lib,
    isa,
    library,
    native_bf16,
    onednn_cap,
    requested_isa,
    set_isa,
)
from .formats import (
    Fp8Weight,
    Int4Weight,
    NVFP4Weight,
    W4A8Weight,
    dequantize_weight,
    format_name,
    select_expert,
    unpack_int4,
    weight_shape,
)
from .reference import Weight, check_offsets

log = logging.getLogger("llama_lite.kernels")

# Rows of one expert up to which the GEMV beats the path for many rows, per path and weight
# format. amx: measured one core, weights in L2 (int4 / w4a8 / nvfp4 GEMV ~1.5x AMX at 1 row and
# ahead at 2; fp8 even at 1 row and behind at 2). avx512: the bf16 dot-product GEMV against
# llk_dpgemm on one 4096 x 2048 expert, 2 Zen 4 cores: at 12 rows 0.96-1.06x, at 16 0.63-0.83x
# (fp8 1.03x; 0.88x at 24). avx2: the GEMV against fp32 tiles + PyTorch's fp32 GEMM (see
# scripts.bench_kernels).
GEMV_MAX_ROWS = {
    "amx": {W_INT4: 2, W_FP4: 2, W_FP8: 1},
    "avx512": {W_INT4: 12, W_FP4: 12, W_FP8: 16},
    "avx2": {W_INT4: 64, W_FP4: 64, W_FP8: 64},
}
# Rows of one expert up to which int4 with int8 activations takes the integer GEMV (q8_library;
# the measurements below were of the AVX2 library's, then on every path): amx multiplies more rows
# with AMX int8 tiles (llk_amx_q8; on the AMX Xeon, the [131072, 5120] stack, each in its own
# process: 3 rows 19.3 ms by the GEMV against 25.9 by tiles, 4 rows 27.5 against 26.4); avx512
# multiplies more rows with VNNI in registers (llk_dpq8), measured so far only on the AMX Xeon under
# the avx512 cap (each in its own process): the stack at 4 rows 25 ms by the GEMV against 33, at 8
# rows 45 against 34-37, at 16 96 against 37; a 16-expert SwiGLU layer (D 1024, F 2048) at 512
# rows, 32 per expert, 37-39 against 9.1-9.3. The GEMV keeps up to 8 rows there, as on Zen 4 (2
# cores) it ran a batch-1 int4 GEMV at 97% of a streaming read and batch 8 at 1.10x bf16; the fp32
# tiles that took more rows before gave 0.26-0.30x of bf16's speed on the 512-row layer with the
# GEMV up to 12 rows, 0.63x with it up to 64.
INT8_GEMV_MAX_ROWS = {"amx": 3, "avx512": 8, "avx2": GEMV_MAX_ROWS["avx2"][W_INT4]}


def q8_library(form: dict) -> ctypes.CDLL:
    """The library whose integer GEMV (``llk_gemv_q8``) a weight with int8 activations takes: the
    AVX-512 one (VNNI, 128-value steps) on amx and avx512 where K and the group size are multiples
    of 128, else the AVX2 one. Both compute the same integer sums and fp32 scalings, in another
    fp32 order."""
    if form["path"] in ("amx", "avx512") and form["k"] % 128 == 0 and form["gs"] % 128 == 0:
        return library("avx512")
    return library("avx2")


# How each path's GEMV multiplies activations that are exact in bf16 (few rows per expert; bf16
# activations, or fp8 / nvfp4-quantized ones): "fp32" decodes weights to fp32 in registers for
# fp32 FMAs (llk_gemv), "bf16" decodes them to bf16 (exact for every format) for vdpbf16ps with
# fp32 sums, int4's group scales applied to each group's sum (llk_gemv_dp). Chosen per CPU kind
# by measurement: on the AMX Xeons we ran, vdpbf16ps ran at half the fp32 FMA's rate (the
# latest, caps amx vs avx512 on the 16-expert stack: the bf16 GEMV took 1.27x the time for int4 at
# batch 1, ~1.0x for fp8 and w4a8, 0.76x for nvfp4, and 1.4-1.8x at batch 8); on AMD EPYC
# Zen 4 (the avx512 path) the bf16 GEMV took 0.47-0.79x the fp32 one's time at batch 1 and
# 0.39-0.74x at batch 8 (16-expert stack, the two alternating in one process; README "CPU
# paths"); on Zen 5 0.76-1.02x at batch 1 and 0.44-0.69x at batch 8. Other fp32 activations take
# the fp32 GEMV everywhere.
GEMV_DOT = {"amx": "fp32", "avx512": "bf16", "avx2": "fp32"}
# Formats whose choice differs from their path's: on the AMX Xeon nvfp4 decodes faster to bf16
# (one 65536 x 5120 layer, the two alternating in one process: 0.79x the time at 1 row, 0.88x at
# 2; on the 16-expert stack 56% -> 74% of a streaming read).
GEMV_DOT_FORMAT = {("amx", W_FP4): "bf16"}


def gemv_max_rows(form: dict) -> int:
    """Rows of one expert up to which a weight's form takes its path's GEMV."""
    if form["act"] == "int8":
        return INT8_GEMV_MAX_ROWS[form["path"]]
    return GEMV_MAX_ROWS[form["path"]][form["wfmt"]]


def gemv_dot(path: str, wfmt: int) -> str:
    """The multiply a path's GEMV uses for this weight format: "fp32" or "bf16" (see GEMV_DOT)."""
    return GEMV_DOT_FORMAT.get((path, wfmt), GEMV_DOT[path])


# Activation rows up to which a bf16 weight goes through a library's GEMV rather than PyTorch's
# GEMM: oneDNN's bf16 GEMM is fast with AVX512-BF16 / AMX, and on AVX2 alone slower than the GEMV
# even at 64 rows (measured ~4x at 8-64 rows on AMD EPYC Zen 3). Without AMX (avx512: AMD EPYC
# Zen 4/5) oneDNN's bf16 GEMM reads a weight at ~21 GB/s whatever the rows and the GEMV took
# 0.6-0.8x its time at 5-8 rows (Zen 5), but at 8 the routed bf16 experts of a short prefill (a few
# rows each) leave PyTorch's GEMM and its exact numbers (summation order), which the kernel model
# promises at prefill (tests/quantization/test_convert.py): 4 until batch decode can be told apart.
BF16_GEMV_MAX_ROWS = {"amx": 4, "avx512": 4, "avx2": 64}
# Weight rows expanded to fp32 at a time for the GEMM of many rows: 512 x 5120 x 4 B = 10 MiB.
PREFILL_TILE_N = 512
# Weight rows dequantized at a time by PyTorch on the ``none`` path.
TORCH_TILE_N = 512
# Rows up to which the ``none`` path uses PyTorch's packed int4 kernel (its fp32 form is slow with
# many rows: 24 s vs 0.5 s for fp32 tiles at 512 rows of an 8192 x 5120 expert, AMD EPYC Zen 3).
INT4PACK_MAX_ROWS = 16


# ---- prepared forms


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _per_expert(t: Optional[torch.Tensor], e1: int) -> Optional[torch.Tensor]:
    """A 0-d or [E] fp32 factor as a contiguous fp32 [E] tensor."""
    if t is None:
        return None
    t = t.detach().to(torch.float64)
    return (t.expand(e1) if t.dim() == 0 else t.reshape(e1)).to(torch.float32).contiguous()


def _kernel_layout(w: Weight, path: str) -> Optional[tuple[int, int, int]]:
    """(weight format, scale format, group size) of the C kernels for ``w``, or None if unsupported."""
    _, _, k = weight_shape(w)
    if isinstance(w, Fp8Weight):
        return (W_FP8, S_NONE, 0) if w.weight.dtype == torch.float8_e4m3fn else None
    if isinstance(w, NVFP4Weight):
        return (W_FP4, S_E4M3, 16) if w.scales.dtype == torch.float8_e4m3fn and k % 16 == 0 else None
    if isinstance(w, Int4Weight) and w.int8_activations and w.group_size % 64:
        return None  # llk_gemv_q8 takes whole 64-value chunks per group
    if isinstance(w, (Int4Weight, W4A8Weight)):
        scales = w.scales if isinstance(w, Int4Weight) else w.group_scales
        sfmt = {torch.bfloat16: S_BF16, torch.float32: S_F32, torch.float16: S_F32, torch.float8_e4m3fn: S_E4M3}
        gs = w.group_size
        # llk.cpp: 32, 64 or a multiple of 128; llk_avx2.cpp: 32 or a multiple of 64
        ok = gs in (32, 64) or (gs > 0 and gs % 128 == 0) if path != "avx2" else gs == 32 or (gs > 0 and gs % 64 == 0)
        if scales.dtype not in sfmt or not ok or k % gs:
            return None
        return W_INT4, sfmt[scales.dtype], gs
    return None


def _llk_form(w: Weight, layout: tuple[int, int, int], path: str) -> dict:
    e, n, k = weight_shape(w)
    e1 = e or 1
    wfmt, sfmt, gs = layout
    if isinstance(w, Fp8Weight):
        data, scales = w.weight.view(torch.uint8), None
    else:
        data = w.qweight
        scales = w.scales if isinstance(w, (Int4Weight, NVFP4Weight)) else w.group_scales
    data = data.reshape(e1, n, -1).contiguous()
    if scales is not None:
        if scales.dtype == torch.float16:
            scales = scales.float()
        scales = scales.reshape(e1, n, -1).contiguous()
        if scales.dtype == torch.float8_e4m3fn:
            scales = scales.view(torch.uint8)
    rowscale = None
    if isinstance(w, Fp8Weight):
        rowscale = w.scale.float().reshape(e1, n).contiguous()
    elif isinstance(w, W4A8Weight):
        rowscale = w.channel_scales.float().reshape(e1, n).contiguous()
    alpha = None
    if isinstance(w, NVFP4Weight):
        g = w.global_scale.double()
        if w.input_global_scale is not None:
            g = g * w.input_global_scale.double()  # activations enter as e2m1 * local
        alpha = _per_expert(1.0 / g, e1)
    cw = LlkWeight(
        _ptr(data), data.stride(0), data.stride(1),
        _ptr(scales), scales.stride(0) if scales is not None else 0, scales.stride(1) if scales is not None else 0,
        _ptr(rowscale), n, _ptr(alpha),
    )  # fmt: skip
    form = dict(
        path=path, wfmt=wfmt, sfmt=sfmt, gs=gs, e=e1, dense=e is None, n=n, k=k, data=data, scales=scales,
        rowscale=rowscale, alpha=alpha, cweight=cw,
    )  # fmt: skip
    if isinstance(w, (Fp8Weight, W4A8Weight)):
        form["act"] = "fp8"
        form["ub"] = w.activation_scale_ub
    elif isinstance(w, NVFP4Weight) and w.input_global_scale is not None:
        form["act"] = "nvfp4"
        form["g_in"] = _per_expert(w.input_global_scale, e1)
    elif isinstance(w, Int4Weight) and w.int8_activations:
        form["act"] = "int8"
    else:
        form["act"] = None
    return form


def _build_cpu_form(w: Weight, path: str) -> dict:
    """The cached form of ``w`` for CPU path ``path`` (see ``prepare``)."""
    e, n, k = weight_shape(w)
    e1 = e or 1
    if path != "none":
        layout = _kernel_layout(w, path)
        if layout is not None:
            return _llk_form(w, layout, path)
    form = dict(path="torch", e=e1, dense=e is None, n=n, k=k)
    if isinstance(w, Int4Weight) and n % 16 == 0 and k % w.group_size == 0 and w.group_size in (32, 64, 128, 256):
        # PyTorch's packed int4 kernel, in fp32 (fp32 activations, scales and accumulation), takes
        # unsigned values with a zero point, w = (u - 8) * scale + zero; u = q + 8 and zero = 0
        # are ours exactly.
        packs = []
        for i in range(e1):
            wi = w if e is None else select_expert(w, i)
            u = (unpack_int4(wi.qweight).to(torch.int32) + 8).contiguous()
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
            sz = torch.stack((wi.scales.float().T, torch.zeros_like(wi.scales.T, dtype=torch.float32)), -1)
            # bf16 scales are exact in the bf16 kernel's scale tensor too
            sz16 = sz.to(torch.bfloat16).contiguous() if wi.scales.dtype == torch.bfloat16 else None
            packs.append((packed, sz.contiguous(), sz16))
        form.update(int4pack=packs, gs=w.group_size)
    return form


def prepare(w: Weight, device=None) -> None:
    """Build the form of ``w`` for the CPU path in force once and cache it in ``w.prepared``; idempotent."""
    _form(w)


def _form(w: Weight) -> dict:
    path = isa()
    forms = w.prepared.setdefault("cpu", {})
    if path not in forms:
        forms[path] = _build_cpu_form(w, path)
    return forms[path]


def describe(w: Weight) -> str:
    """Which CPU path ``w`` takes, in words (for the dispatch log line)."""
    path = isa()
    if isinstance(w, torch.Tensor):
        if path == "none" or w.dtype != torch.bfloat16:
            return "cpu/none: PyTorch matmul"
        big = "PyTorch bf16 GEMM" if native_bf16() else "fp32 weight tiles + PyTorch fp32 GEMM"
        if onednn_cap():
            big += f" (oneDNN up to {onednn_cap()})"
        return f"cpu/{path}: bf16 GEMV up to {BF16_GEMV_MAX_ROWS[path]} rows, {big} above"
    form = _form(w)
    if form["path"] == "torch":
        why = "" if path == "none" else " (no C kernel for this layout)"
        if "int4pack" in form:
            return f"cpu/none{why}: PyTorch _weight_int4pack_mm_for_cpu up to {INT4PACK_MAX_ROWS} rows, fp32 tiles above"
        return f"cpu/none{why}: PyTorch, fp32 tiles of {TORCH_TILE_N} rows"
    rows = gemv_max_rows(form)
    big = {"amx": "AMX fused dequant-GEMM",
           "avx512": "bf16-dot dequant-GEMM (llk_dpgemm) for activations exact in bf16, else fp32 weight tiles + PyTorch fp32 GEMM",
           }.get(path, "fp32 weight tiles + PyTorch fp32 GEMM")  # fmt: skip
    if form["act"] == "int8":
        big = {"amx": "AMX int8 tiles (llk_amx_q8)", "avx512": "AVX-512 VNNI in registers (llk_dpq8)"}.get(
            path, f"the int8 activations in fp32 through the {big}")
        return f"cpu/{path}: int4 x int8 integer GEMV up to {rows} rows per expert, {big} above"
    dot = gemv_dot(path, form["wfmt"])
    gemv = "fp32-FMA" if dot == "fp32" else "bf16-dot (vdpbf16ps; fp32 FMA for fp32 activations)"
    return f"cpu/{path}: {gemv} fused dequant-GEMV up to {rows} rows per expert, {big} above"


# ---- activation preparation


_perm_cache: dict[tuple, torch.Tensor] = {}


def _block_order_avx512(order: str, wfmt: int) -> torch.Tensor:
    """K positions of one 64-byte weight block, in the order llk.cpp's decoders produce them."""
    if order == "dp":  # int4 / e2m1 for llk_gemv_dp: z[j] word w <- 4w + j
        assert wfmt in (W_INT4, W_FP4)
        j, w = torch.meshgrid(torch.arange(4), torch.arange(32), indexing="ij")
        return (4 * w + j).flatten()
    if order == "tile":
        if wfmt == W_FP8:  # z[j] word 8L+t <- 16L+8j+t
            j, lane, t = torch.meshgrid(torch.arange(2), torch.arange(4), torch.arange(8), indexing="ij")
            return (16 * lane + 8 * j + t).flatten()
        # 4-bit: per 16 bytes c, word j <- 32c + 4 (j % 8) + j / 8
        c, j = torch.meshgrid(torch.arange(4), torch.arange(32), indexing="ij")
        return (32 * c + 4 * (j % 8) + j // 8).flatten()
    if wfmt == W_FP8:  # vectors z0.even, z0.odd, z1.even, z1.odd; word w of z[j] <- 16(w/8) + 8j + w%8
        tile = _block_order_avx512("tile", W_FP8).view(2, 16, 2)  # [j, pair, even/odd]
        return tile.permute(0, 2, 1).flatten()
    # 4-bit gemv: per 16 bytes c, lo lane i <- 32c + 2 b(i), hi lane i <- 32c + 2 b(i) + 1,
    # b(i) = 4 (i % 4) + i / 4
    c, h, i = torch.meshgrid(torch.arange(4), torch.arange(2), torch.arange(16), indexing="ij")
    return (32 * c + 2 * (4 * (i % 4) + i // 4) + h).flatten()


def _block_order(lib: str, order: str, wfmt: int) -> torch.Tensor:
    if lib == "avx512":
        return _block_order_avx512(order, wfmt)
    buf = (ctypes.c_int32 * 64)()
    count = library("avx2").llk_gemv_order(wfmt, buf)
    return torch.tensor(list(buf[:count]), dtype=torch.long)


def _perm(lib: str, order: str, wfmt: int, k: int) -> torch.Tensor:
    """Gather index [Kp] turning x [.., K] (with a zero column appended at K) into kernel order."""
    key = (lib, order, wfmt, k)
    if key not in _perm_cache:
        blk = _block_order(lib, order, wfmt)
        nblk = -(-k // blk.numel())
        idx = (torch.arange(nblk).unsqueeze(1) * blk.numel() + blk).flatten()
        _perm_cache[key] = torch.where(idx < k, idx, k).to(torch.int32)  # int32: what the libraries read
    return _perm_cache[key]


def _permute(x: torch.Tensor, lib: str, order: str, wfmt: int) -> torch.Tensor:
    """x [T, K] (fp32 or bf16) -> contiguous [T, Kp] in kernel order, zero padded, same dtype.

    The library's gather (``llk_gather_cols``): PyTorch's ``index_select`` along rows took 0.13-0.22
    ms for 8 bf16 rows of 5120 and 8-15 ms for 512 on an AMX Xeon (the gather: 0.03 and 1.6 ms).
    """
    k = x.shape[1]
    perm = _perm(lib, order, wfmt, k)
    if lib == "avx2" and wfmt == W_FP8 and perm.numel() == k:
        return x.contiguous()  # fp8 decodes in K order
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], perm.numel(), dtype=x.dtype)
    rc = library(lib).llk_gather_cols(x.data_ptr(), x.stride(0), x.shape[0], k, perm.data_ptr(), perm.numel(),
                                      out.data_ptr(), x.element_size(), torch.get_num_threads())
    _check(rc, "llk_gather_cols")
    return out


def _dp_order(form: dict) -> str:
    """The activation order llk_gemv_dp reads for this weight: "dp" for int4 / w4a8 with groups of
    a multiple of 128 values and nvfp4 with K a multiple of 128 (its one-lookup-per-32-values
    decoder), else the tile order."""
    if form["wfmt"] == W_INT4 and form["gs"] % 128 == 0 or form["wfmt"] == W_FP4 and form["k"] % 128 == 0:
        return "dp"
    return "tile"


def _amx_order(form: dict) -> str:
    """The activation order llk_amx reads: "dp" for int4 / w4a8 with groups of a multiple of 128
    values (its tile decoder is then the bf16 GEMV's shuffle-free one), else "tile"."""
    return "dp" if form["wfmt"] == W_INT4 and form["gs"] % 128 == 0 else "tile"


def _split_bf16(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] fp32 -> bf16 [3T, K]: rows 3i, 3i+1, 3i+2 sum to row i exactly.

    Each part takes the next 8 significant bits of what the ones before left (each difference is
    exact in fp32), so 3 x 8 bits hold all 24 of an fp32. Two parts (16 bits) were not enough:
    the 2^-17 they drop moved int8-quantized SwiGLU activations across rounding boundaries.
    """
    hi = x.to(torch.bfloat16)
    r = x - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return torch.stack((hi, mid, lo), dim=1).reshape(-1, x.shape[1])


def _activations(form: dict, x: torch.Tensor, off: list[int]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The values the weights multiply, fp32 [T, K] in K order, and the per-token scale (fp8) or None.

    Quantized activations come back exactly (e4m3 values; nvfp4 as e2m1 * local scale, the global
    scale being in the weight's alpha).
    """
    lib = gemv_lib(form["path"])
    nt = torch.get_num_threads()
    if form["act"] is None:
        return x if x.dtype == torch.float32 else x.float(), None
    xf = x.float().contiguous()
    rows, k = xf.shape
    if form["act"] == "fp8":
        q = torch.empty(rows, k, dtype=torch.float32)
        s = torch.empty(rows, dtype=torch.float32)
        ub = form["ub"]
        lib.llk_quant_fp8_rows(xf.data_ptr(), rows, k, k, float(ub) if ub is not None else -1.0,
                               q.data_ptr(), None, k, s.data_ptr(), nt)  # fmt: skip
        return q, s
    if form["act"] == "nvfp4":
        g = form["g_in"]
        if form["e"] > 1:
            counts = torch.tensor([b - a for a, b in zip(off, off[1:])])
            g_rows = torch.zeros(rows)
            g_rows[off[0] : off[-1]] = torch.repeat_interleave(g, counts)
        else:
            g_rows = g.expand(rows).contiguous()
        q = torch.empty(rows, k, dtype=torch.float32)
        lib.llk_quant_nvfp4_rows(xf.data_ptr(), rows, k, k, g_rows.data_ptr(), q.data_ptr(), k, nt)
        return q, None
    raise AssertionError(form["act"])


# ---- running the kernels


def _rows_array(values: list[int]) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)


def _args(form: dict, x: torch.Tensor, tokscale, out, starts, ends, form3: Optional[dict]) -> LlkArgs:
    """The C argument block; ``starts`` / ``ends`` are ctypes int64 arrays the caller keeps alive."""
    a = LlkArgs()
    a.wfmt, a.sfmt, a.gs, a.nthreads = form["wfmt"], form["sfmt"], form["gs"], torch.get_num_threads()
    a.N, a.K, a.E = form["n"], form["k"], form["e"]
    if starts is not None:
        a.row_start, a.row_end = ctypes.addressof(starts), ctypes.addressof(ends)
    a.x, a.ldx = x.data_ptr(), x.stride(0)
    a.tokscale = _ptr(tokscale)
    a.out, a.ldo = _ptr(out), out.stride(0) if out is not None else 0
    a.w1 = form["cweight"]
    if form3 is not None:
        a.w3 = form3["cweight"]
    return a


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"{what} rejected a layout that prepare() accepted")  # a bug, not a user error


def _tile_expert(form: dict, xe: torch.Tensor, e: int, tok: Optional[torch.Tensor]) -> torch.Tensor:
    """fp32 [rows, N] for one expert: exact fp32 weight tiles (AVX2 library order) times xe, fp32 GEMM."""
    n, kp = form["n"], xe.shape[1]
    out = torch.empty(xe.shape[0], n, dtype=torch.float32)
    buf = torch.empty(min(PREFILL_TILE_N, n), kp, dtype=torch.float32)
    a = _args(form, buf, None, None, None, None, None)
    lib = library("avx2")
    for n0 in range(0, n, PREFILL_TILE_N):
        n1 = min(n0 + PREFILL_TILE_N, n)
        _check(lib.llk_dequant_f32(ctypes.byref(a), e, n0, n1, buf.data_ptr(), kp), "llk_dequant_f32")
        out[:, n0:n1] = xe @ buf[: n1 - n0].T
    if form["rowscale"] is not None:
        out *= form["rowscale"][e]
    if form["alpha"] is not None:
        out *= form["alpha"][e]
    if tok is not None:
        out *= tok.unsqueeze(1)
    return out


# Argument blocks kept per weight form, one per (row split, threads) seen at decode: at batch 1
# that is one per expert. Beyond this many (varied batches), the cache starts over.
_DECODE_CALLS = 64


def _io_plan(form: dict, form3: Optional[dict] = None) -> tuple:
    """(form3, library function, C argument block as bytes, activation order, per-split calls) of
    the bf16-in, bf16-out GEMV of a form whose activations are not quantized (or int8), built once
    per form (per W3 for a SwiGLU) and kept in it."""
    key = "io" if form3 is None else "io3"
    plan = form.get(key)
    if plan is None or (form3 is not None and plan[0] is not form3):
        lib_name = "avx2" if form["path"] == "avx2" else "avx512"
        if form["act"] == "int8":  # an integer GEMV (q8_library); it reads K order
            perm, fn = torch.arange(form["k"]), q8_library(form).llk_gemv_q8_bf16io
        elif gemv_dot(form["path"], form["wfmt"]) == "bf16":
            perm = _perm("avx512", _dp_order(form), form["wfmt"], form["k"])
            fn = gemv_lib(form["path"]).llk_gemv_dp_bf16io
        else:
            perm, fn = _perm(lib_name, "gemv", form["wfmt"], form["k"]), gemv_lib(form["path"]).llk_gemv_bf16io
            if lib_name == "avx2" and form["wfmt"] == W_FP8:
                perm = torch.arange(-(-form["k"] // 32) * 32)  # fp8 decodes in K order
        perm = perm.to(torch.int32).contiguous()
        template = _args(form, perm, None, None, None, None, form3)
        plan = form[key] = (form3, fn, bytes(template), perm, {})
    return plan


def one_call_gemv(w: Weight, w3: Optional[Weight] = None) -> Optional[tuple]:
    """(library function, a fresh C argument block, activation order) of the one-call GEMV that
    decode uses for ``w`` (bf16 rows in, bf16 out; with ``w3``: silu(x W.T) * (x W3.T)), for a
    caller that runs it from C; None where decode would not take it (``_decode_bf16``). The
    block's row_start / row_end are the caller's to set; its threads are PyTorch's now."""
    if isinstance(w, torch.Tensor) or (w3 is not None and (type(w3) is not type(w) or isinstance(w3, torch.Tensor))):
        return None
    form = _form(w)
    form3 = _form(w3) if w3 is not None else None
    if form["path"] == "torch" or form["act"] not in (None, "int8") or (form3 is not None and not _fusable(form, form3)):
        return None
    _, fn, template, perm, _ = _io_plan(form, form3)
    args = LlkArgs.from_buffer_copy(template)
    args.nthreads = torch.get_num_threads()
    return fn, args, perm


def one_call_gemv_bf16(w: torch.Tensor) -> Optional[tuple]:
    """(library function, weight, row stride, N, K) of the GEMV ``linear`` uses for one bf16 row
    times the bf16 weight ``w`` [N, K] (``llk_gemv_bf16``), for a caller that runs it from C; None
    where ``linear`` would not take it (``_gemv_bf16``)."""
    path = isa()
    if path == "none" or not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype != torch.bfloat16:
        return None
    if w.stride(1) != 1 or w.device.type != "cpu":
        return None
    return gemv_lib(path).llk_gemv_bf16, w, w.stride(0), w.shape[0], w.shape[1]


class LlkGemvCall(ctypes.Structure):
    """A one-call GEMV as C code that runs several calls it (``LlkGemvCall`` in llk_avx2.cpp)."""

    _fields_ = [("fn", ctypes.c_void_p), ("args", ctypes.c_void_p), ("perm", ctypes.c_void_p), ("kp", ctypes.c_int64)]

    @classmethod
    def of(cls, gemv: tuple, keep: list) -> "LlkGemvCall":
        """From ``one_call_gemv``'s result; what the struct points to joins ``keep``."""
        fn, args, perm = gemv
        keep += [args, perm]
        return cls(ctypes.cast(fn, ctypes.c_void_p).value, ctypes.addressof(args), perm.data_ptr(), perm.numel())


def _decode_bf16(form: dict, x: torch.Tensor, off: list[int], form3: Optional[dict] = None) -> Optional[torch.Tensor]:
    """What ``_run(...).to(torch.bfloat16)`` returns, in one library call, or None where it does not apply.

    Decode's case: bf16 x, weights whose activations are not quantized (or int8, which the
    library quantizes itself), every row in an expert that takes the GEMV. The library widens x
    into its order and rounds the fp32 results to bf16 itself (the same operations as the general
    path, so the same bits), which saves four PyTorch ops and ~25 us of Python per call. The C
    argument block of each row split is built once and kept (``_DECODE_CALLS``), so a call costs
    one dictionary lookup, one ``torch.empty`` and the library call.
    """
    if x.dtype != torch.bfloat16 or form["act"] not in (None, "int8") or x.stride(-1) != 1:
        return None
    plan = _io_plan(form, form3)
    _, fn, template, perm, calls = plan
    t, nt = x.shape[0], torch.get_num_threads()
    call = calls.get((t, nt, *off))
    if call is None:
        if off[0] != 0 or off[-1] != t:
            return None
        limit = gemv_max_rows(form)
        if any(b - a > limit for a, b in zip(off, off[1:])):
            return None
        a = LlkArgs.from_buffer_copy(template)
        a.nthreads = nt
        starts, ends = _rows_array(off[:-1]), _rows_array(off[1:])
        a.row_start, a.row_end = ctypes.addressof(starts), ctypes.addressof(ends)
        if len(calls) >= _DECODE_CALLS:
            calls.clear()
        call = calls[t, nt, *off] = (ctypes.byref(a), perm.data_ptr(), perm.numel(), form["n"], starts, ends)
    args, perm_ptr, perm_len, n = call[:4]
    out = torch.empty(t, n, dtype=torch.bfloat16)
    _check(fn(args, perm_ptr, perm_len, t, x.data_ptr(), x.stride(0), out.data_ptr(), n), "llk_gemv_bf16io")
    return out


def _run(form: dict, x: torch.Tensor, off: list[int], form3: Optional[dict] = None) -> torch.Tensor:
    """fp32 [T, N] (rows outside off[0]:off[E] zero) for x [T, K] grouped by ``off``.

    With ``form3`` (W3 of a SwiGLU), the result is silu(x W1.T) * (x W3.T).
    """
    if form["act"] == "int8":
        return _run_int8(form, x, off, form3)
    path = form["path"]
    lib, lib_name = gemv_lib(path), ("avx2" if path == "avx2" else "avx512")
    e1, n, wfmt = form["e"], form["n"], form["wfmt"]
    t = x.shape[0]
    xa, tok = _activations(form, x, off)
    # every row is written when the experts' rows cover all of x; otherwise the rest must be zero
    out = (torch.empty if off[0] == 0 and off[-1] == t else torch.zeros)(t, n, dtype=torch.float32)
    counts = [b - a for a, b in zip(off, off[1:])]
    limit = GEMV_MAX_ROWS[path][wfmt]
    small = [0 < c <= limit for c in counts]
    if any(small):
        starts = _rows_array([off[i] if small[i] else 0 for i in range(e1)])
        ends = _rows_array([off[i + 1] if small[i] else 0 for i in range(e1)])
        # quantized activations (e4m3 values; e2m1 x e4m3) are exact in bf16, as bf16 x is
        if gemv_dot(path, wfmt) == "bf16" and (form["act"] is not None or x.dtype == torch.bfloat16):
            xg = _permute(xa.to(torch.bfloat16) if form["act"] is not None else x, "avx512", _dp_order(form), wfmt)
            _check(lib.llk_gemv_dp(ctypes.byref(_args(form, xg, tok, out, starts, ends, form3))), "llk_gemv_dp")
        else:
            xg = _permute(xa, lib_name, "gemv", wfmt)
            _check(lib.llk_gemv(ctypes.byref(_args(form, xg, tok, out, starts, ends, form3))), "llk_gemv")
    large = [i for i in range(e1) if counts[i] > limit]
    if not large:
        return out
    exact = form["act"] is not None or x.dtype == torch.bfloat16
    if path == "amx" or path == "avx512" and exact:
        # on amx a fp32 input that is not exactly bf16 goes in as three bf16 rows, on avx512 it
        # takes the fp32 tiles below
        if exact:
            _tile_gemm(form, x, xa, tok, off, large, form3, out)
            return out
        gemm, gemm_name = _tile_library(path)
        rep = 3
        xt = _permute(_split_bf16(xa), "avx512", _amx_order(form), wfmt)
        starts = _rows_array([a * rep for a in off[:-1]])
        ends = _rows_array([a * rep for a in off[1:]])

        def products(f: dict) -> torch.Tensor:  # x W.T of the large experts, the three parts summed
            out_t = torch.zeros(t * rep, n, dtype=torch.float32)
            args = _args(f, xt, tok, out_t, starts, ends, None)
            for i in large:
                _check(gemm(ctypes.byref(args), i, xt.shape[1]), gemm_name)
            return out_t.view(t, rep, n).sum(dim=1)

        # the SwiGLU epilogue needs whole products, not each part's apart
        summed = products(form) if form3 is None else F.silu(products(form)) * products(form3)
        for i in large:
            out[off[i] : off[i + 1]] = summed[off[i] : off[i + 1]]
        return out
    xt = _permute(xa, "avx2", "gemv", wfmt)
    for i in large:
        rows = slice(off[i], off[i + 1])
        tok_i = tok[rows] if tok is not None else None
        y = _tile_expert(form, xt[rows], i, tok_i)
        if form3 is not None:
            y = F.silu(y) * _tile_expert(form3, xt[rows], i, tok_i)
        out[rows] = y
    return out


def _tile_library(path: str) -> tuple[ctypes._CFuncPtr, str]:
    """The entry for many rows per expert of activations exact in bf16: llk_amx on amx, its form
    without AMX (llk_dpgemm) on avx512."""
    lib = gemv_lib(path)
    return (lib.llk_amx, "llk_amx") if path == "amx" else (lib.llk_dpgemm, "llk_dpgemm")


def _tile_gemm(form: dict, x: torch.Tensor, xa: torch.Tensor, tok: Optional[torch.Tensor], off: list[int],
               large: list[int], form3: Optional[dict], out: Optional[torch.Tensor],
               out16: Optional[torch.Tensor] = None) -> None:
    """Rows of the experts ``large`` into out (fp32) or out16 (bf16, rounded by the library) through
    the tile path of amx / avx512, for activations exact in bf16: x the input, xa and tok what
    ``_activations`` made of it (x itself where they are not quantized). They go in as bf16 in the
    order llk_amx reads (llk_dpgemm reads the same)."""
    gemm, gemm_name = _tile_library(form["path"])
    xb = x if form["act"] is None else xa.to(torch.bfloat16)  # bf16 x as it came
    xt = _permute(xb, "avx512", _amx_order(form), form["wfmt"])
    starts, ends = _rows_array(off[:-1]), _rows_array(off[1:])
    args = _args(form, xt, tok, out, starts, ends, form3)
    if out16 is not None:
        args.out16, args.ldo = out16.data_ptr(), out16.stride(0)
    for i in large:
        _check(gemm(ctypes.byref(args), i, xt.shape[1]), gemm_name)


def _tiles_bf16(form: dict, x: torch.Tensor, off: list[int], form3: Optional[dict] = None) -> Optional[torch.Tensor]:
    """What ``_run(...).to(torch.bfloat16)`` returns, or None where it does not apply.

    Prefill's case: bf16 x on amx or avx512, weights whose activations are not int8, every row in
    an expert that takes the tile path. The library rounds its fp32 results to bf16 as it writes
    them (as PyTorch's conversion does: the same bits), which saves writing, reading and converting
    an fp32 result as large as the bf16 one twice over.
    """
    t = x.shape[0]
    if form["path"] not in ("amx", "avx512") or x.dtype != torch.bfloat16 or form["act"] == "int8":
        return None
    limit = gemv_max_rows(form)
    # decode (t <= limit) declines before looking at the experts
    if t <= limit or off[0] != 0 or off[-1] != t or any(0 < b - a <= limit for a, b in zip(off, off[1:])):
        return None
    xa, tok = _activations(form, x, off) if form["act"] is not None else (x, None)
    out16 = torch.empty(t, form["n"], dtype=torch.bfloat16)
    large = [i for i in range(form["e"]) if off[i + 1] > off[i]]
    _tile_gemm(form, x, xa, tok, off, large, form3, None, out16)
    return out16


def _bf16_result(form: dict, x: torch.Tensor, off: list[int], form3: Optional[dict] = None) -> Optional[torch.Tensor]:
    """``_run(...).to(torch.bfloat16)`` rounded in the library, where decode (``_decode_bf16``) or
    prefill (``_tiles_bf16``) allows it; else None."""
    out = _decode_bf16(form, x, off, form3)
    return out if out is not None else _tiles_bf16(form, x, off, form3)


def _run_int8(form: dict, x: torch.Tensor, off: list[int], form3: Optional[dict]) -> torch.Tensor:
    """``_run`` for int4 weights with int8 activations: experts with few rows through an integer
    GEMV (llk_gemv_q8 of ``q8_library``: AVX-512 VNNI or AVX2), which quantizes the activations
    itself; experts with many rows through AMX int8 tiles on amx (llk_amx_q8, which quantizes them
    the same way) or VNNI in registers on avx512 (llk_dpq8), on avx2 the reference's dequantized
    int8 activations (exact in fp32) through the path for unquantized activations."""
    e1, t = form["e"], x.shape[0]
    counts = [b - a for a, b in zip(off, off[1:])]
    limit = gemv_max_rows(form)
    out = (torch.empty if off[0] == 0 and off[-1] == t else torch.zeros)(t, form["n"], dtype=torch.float32)
    small = [0 < c <= limit for c in counts]
    large = [c if c > limit else 0 for c in counts]
    in_library = any(large) and form["path"] in ("amx", "avx512")  # many rows quantized there too
    # fp32 rows for the library to quantize, kept alive while it runs (its arguments hold the address)
    xf = x.float().contiguous() if any(small) or in_library else None
    if any(small):
        starts = _rows_array([off[i] if small[i] else 0 for i in range(e1)])
        ends = _rows_array([off[i + 1] if small[i] else 0 for i in range(e1)])
        args = _args(form, xf, None, out, starts, ends, form3)
        _check(q8_library(form).llk_gemv_q8(ctypes.byref(args)), "llk_gemv_q8")
    if in_library:
        # integer products in the library (AMX tiles, or AVX-512 VNNI in registers), the
        # activations quantized there as the GEMV does it
        name = "llk_amx_q8" if form["path"] == "amx" else "llk_dpq8"
        gemm = getattr(library("avx512"), name)
        starts, ends = _rows_array(off[:-1]), _rows_array(off[1:])
        args = _args(form, xf, None, out, starts, ends, form3)
        for i in range(e1):
            if large[i]:
                _check(gemm(ctypes.byref(args), i), name)
    elif any(large):
        # one call for every expert with many rows (quantization is per row, so all at once)
        plain = dict(form, act=None)
        plain3 = dict(form3, act=None) if form3 is not None else None
        local = [0]
        for c in large:
            local.append(local[-1] + c)
        if local[-1] == t and off[0] == 0:  # every row: no gather
            out[:] = _run(plain, reference.fake_quantize_int8_activations(x), local, plain3)
        else:
            rows = torch.cat([torch.arange(off[i], off[i + 1]) for i in range(e1) if large[i]])
            out[rows] = _run(plain, reference.fake_quantize_int8_activations(x[rows]), local, plain3)
    return out


# ---- PyTorch-only path


def _row_slice(w: Weight, n0: int, n1: int) -> Weight:
    """Rows n0:n1 of a 2-D weight, same format (scales and per-row factors sliced alike)."""
    if isinstance(w, Int4Weight):
        return Int4Weight(w.qweight[n0:n1], w.scales[n0:n1], w.group_size, w.int8_activations)
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.weight[n0:n1], w.scale[n0:n1], w.activation_scale_ub)
    if isinstance(w, W4A8Weight):
        return W4A8Weight(w.qweight[n0:n1], w.group_scales[n0:n1], w.channel_scales[n0:n1], w.group_size,
                          w.activation_scale_ub)  # fmt: skip
    return NVFP4Weight(w.qweight[n0:n1], w.scales[n0:n1], w.global_scale, w.input_global_scale)


def _torch_rows(form: dict, x: torch.Tensor, w: Weight, e: int, fp32_out: bool) -> torch.Tensor:
    """fp32 [rows, N] of x times one expert's 2-D weight ``w``, PyTorch only. ``fp32_out``: the
    caller uses the products unrounded (SwiGLU's W1 / W3), else it rounds them to x.dtype."""
    if isinstance(w, Int4Weight) and w.int8_activations:
        x = reference.fake_quantize_int8_activations(x)  # exact fp32 values; then as unquantized
    if "int4pack" in form and x.shape[0] <= INT4PACK_MAX_ROWS:
        packed, sz, sz16 = form["int4pack"][e]
        if x.dtype == torch.bfloat16 and not fp32_out and sz16 is not None:
            # its bf16 kernel: fp32 sums rounded once to bf16, as the caller rounds ours
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, form["gs"], sz16).float()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.float().contiguous(), packed, form["gs"], sz)
    # the reference's activation quantization once, then fp32 weight tiles
    tok = None
    if isinstance(w, (Fp8Weight, W4A8Weight)):
        xq, tok = reference.quantize_fp8_per_token(x, w.activation_scale_ub)
        xa = xq.float()
    elif isinstance(w, NVFP4Weight) and w.input_global_scale is not None:
        xa = reference.fake_quantize_nvfp4_activations(x, w.input_global_scale)
    else:
        xa = x.float()
    out = torch.empty(x.shape[0], form["n"], dtype=torch.float32)
    for n0 in range(0, form["n"], TORCH_TILE_N):
        n1 = min(n0 + TORCH_TILE_N, form["n"])
        out[:, n0:n1] = xa @ dequantize_weight(_row_slice(w, n0, n1)).T
    return out if tok is None else out * tok


# ---- public functions (same signatures as kernels.reference)


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"activations have {x.shape[-1]} features but the weight expects {k}")
    return x.reshape(-1, k)


def _grouped_fp32(x2: torch.Tensor, off: list[int], w: Weight, fp32_out: bool = False) -> torch.Tensor:
    """fp32 [T, N] of x2 [T, K] grouped by ``off`` (one group for a 2-D weight), any path
    (``fp32_out``: see ``_torch_rows``)."""
    if isinstance(w, torch.Tensor):
        w3 = w.unsqueeze(0) if w.dim() == 2 else w
        out = torch.zeros(x2.shape[0], w3.shape[1], dtype=torch.float32)
        for i in range(w3.shape[0]):
            if off[i + 1] > off[i]:
                rows = x2[off[i] : off[i + 1]]
                fast = _gemv_bf16(rows, w3[i]) if rows.dtype == w3.dtype else None
                out[off[i] : off[i + 1]] = fast if fast is not None else F.linear(rows, w3[i].to(x2.dtype))
        return out
    form = _form(w)
    if form["path"] != "torch":
        return _run(form, x2, off)
    out = torch.zeros(x2.shape[0], form["n"], dtype=torch.float32)
    e = weight_shape(w)[0]
    for i in range(form["e"]):
        if off[i + 1] > off[i]:
            we = w if e is None else select_expert(w, i)
            out[off[i] : off[i + 1]] = _torch_rows(form, x2[off[i] : off[i + 1]], we, i, fp32_out)
    return out


def _grouped(x2: torch.Tensor, off: list[int], w: Weight) -> torch.Tensor:
    """[T, N] of x2 [T, K] grouped by ``off``, in x2.dtype."""
    if not isinstance(w, torch.Tensor):
        form = _form(w)
        if form["path"] != "torch":
            out = _bf16_result(form, x2, off)
            if out is not None:
                return out
    return _grouped_fp32(x2, off, w).to(x2.dtype)


def _dense(w: Weight) -> tuple[int, int]:
    e, n, k = weight_shape(w)
    if e is not None:
        raise ValueError("linear() takes a 2-D weight [N, K]; use grouped_linear for [E, N, K] expert weights")
    return n, k


def _experts(w: Weight) -> int:
    e, _, _ = weight_shape(w)
    if e is None:
        raise ValueError("grouped kernels take expert weights [E, N, K]; use linear for a 2-D weight")
    return e


def _gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> Optional[torch.Tensor]:
    """x [..., K] @ W.T for bf16 x and W with a library's GEMV, or None where it does not apply."""
    n, k = w.shape
    x2 = x.reshape(-1, k)
    path = isa()
    if path == "none" or x2.shape[0] > BF16_GEMV_MAX_ROWS[path]:
        return None
    if w.stride(1) != 1 or w.device.type != "cpu" or w.dtype != torch.bfloat16:
        return None
    x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
    gemv_lib(path).llk_gemv_bf16(w.data_ptr(), w.stride(0), n, k, x2.data_ptr(), k, x2.shape[0], out.data_ptr(), n,
                                  torch.get_num_threads())  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def _bf16_gemm(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] @ W.T by oneDNN's bf16 GEMM, in the form that was faster on this kind of CPU (the
    two give the same bits: tests/kernels/test_cpu.py). With the weight as left operand, (w @ x.T).T,
    oneDNN reads it in place; F.linear copies it into a blocked layout on every call. On AMX Xeons
    the first saved ~40% in prefill GEMMs (the core's ``linear`` takes it). Without AMX (AMD EPYC
    Zen 5, AVX512-BF16) F.linear was the faster, 1.1-1.6x at 8-512 rows of 2048 x 4096 expert
    matrices (1.2-1.6x at the 50-80 rows per routed expert of a 512-token prefill, 1.1x at 512)."""
    if cpu_isas()[0] == "amx":
        return (w @ x2.T).T.contiguous()
    return F.linear(x2, w)


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x.dtype."""
    if isinstance(w, torch.Tensor) and x.dtype == w.dtype:
        # A few bf16 rows (decode): a library's GEMV reads weights at the memory roofline, which
        # PyTorch's bf16 GEMV does not reach on every CPU; more rows: PyTorch's GEMM.
        if w.dtype != torch.bfloat16 or w.dim() != 2:
            return F.linear(x, w)
        out = _gemv_bf16(x, w)
        if out is not None:
            return out
        x2 = x.reshape(-1, w.shape[1])
        if not native_bf16():
            # without AVX512-BF16, PyTorch's bf16 GEMM runs at a few GFLOP/s: fp32 tiles of the
            # weight (exact) and its fp32 GEMM, the same numbers (exact products, fp32 sums)
            out = torch.empty(x2.shape[0], w.shape[0], dtype=x.dtype)
            xf = x2.float()
            for n0 in range(0, w.shape[0], PREFILL_TILE_N):
                out[:, n0 : n0 + PREFILL_TILE_N] = xf @ w[n0 : n0 + PREFILL_TILE_N].float().T
            return out.view(*x.shape[:-1], w.shape[0])
        return _bf16_gemm(x2, w).view(*x.shape[:-1], w.shape[0])
    form = _form(w)  # the weight's shape from its cached form: no container inspected per call
    if not form["dense"]:
        _dense(w)  # raises
    x2 = _rows(x, form["k"])
    out = _bf16_result(form, x2, [0, x2.shape[0]]) if form["path"] != "torch" else None
    if out is None:
        out = _grouped_fp32(x2, [0, x2.shape[0]], w).to(x2.dtype)
    return out.view(*x.shape[:-1], form["n"])


def grouped_linear(x: torch.Tensor, offsets: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [T, K] with rows offsets[e]:offsets[e+1] for expert e -> [T, N] in x.dtype."""
    e = _experts(w)
    off = check_offsets(offsets, e, x.shape[0])
    return _grouped(_rows(x, weight_shape(w)[2]), off, w)


def _fusable(f1: dict, f3: dict) -> bool:
    """The forms of W1 and W3 (same container type) can run in one kernel call: same layout, same
    activation quantization. Decided once per pair and kept in W1's form."""
    pair = f1.get("pair")
    if pair is None or pair[0] is not f3:
        same = f1["path"] != "torch" and f3["path"] != "torch"
        same = same and all(f1[key] == f3[key] for key in ("wfmt", "sfmt", "gs", "e", "n", "k", "act"))
        if same and f1["act"] == "fp8":
            same = f1["ub"] == f3["ub"]
        if same and f1["act"] == "nvfp4":
            same = torch.equal(f1["g_in"], f3["g_in"])
        pair = f1["pair"] = (f3, same)
    return pair[1]


def _swiglu_hidden(x2: torch.Tensor, off: list[int], w1: Weight, w3: Weight) -> torch.Tensor:
    """h = silu(x W1.T) * (x W3.T) from fp32 products, in x.dtype."""
    if not isinstance(w1, torch.Tensor) and type(w1) is type(w3) and x2.dtype == torch.bfloat16:
        f1, f3 = _form(w1), _form(w3)
        if _fusable(f1, f3):
            out = _bf16_result(f1, x2, off, f3)
            return out if out is not None else _run(f1, x2, off, f3).to(x2.dtype)
    return (F.silu(_grouped_fp32(x2, off, w1, True)) * _grouped_fp32(x2, off, w3, True)).to(x2.dtype)


def grouped_swiglu(x: torch.Tensor, offsets: torch.Tensor, w1: Weight, w3: Weight, w2: Weight) -> torch.Tensor:
    """Per expert: (silu(x W1.T) * (x W3.T)) W2.T -> [T, D] in x.dtype.

    W1 and W3 share one activation quantization and one kernel call (two accumulators per row,
    SwiGLU in the epilogue), so h is written once; W2 is a second grouped call on the same rows.
    """
    e = _experts(w1)
    off = check_offsets(offsets, e, x.shape[0])
    h = _swiglu_hidden(_rows(x, weight_shape(w1)[2]), off, w1, w3)
    e2, _, k2 = weight_shape(w2)
    if e2 != e:
        return grouped_linear(h, offsets, w2)  # raises the mismatch
    return _grouped(_rows(h, k2), off, w2)


def swiglu(x: torch.Tensor, w1: Weight, w3: Weight, w2: Weight) -> torch.Tensor:
    """Dense SwiGLU FFN (the shared expert): (silu(x W1.T) * (x W3.T)) W2.T -> [..., D]."""
    _, k = _dense(w1)
    x2 = _rows(x, k)
    out = linear(_swiglu_hidden(x2, [0, x2.shape[0]], w1, w3), w2)
    return out.reshape(*x.shape[:-1], out.shape[-1])


__all__ = [
    "ISAS", "cpu_isas", "set_isa", "requested_isa", "isa", "available", "amx_available",
    "linear", "grouped_linear", "grouped_swiglu", "swiglu", "prepare", "describe", "format_name",
]  # fmt: skip
