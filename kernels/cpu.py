"""CPU fast paths: a small AVX-512/AMX C++ library (kernels/csrc/llk.cpp) driven through ctypes.

Why a C library, and why this shape:
* Decode (a few rows) is bound by reading the weights once. PyTorch has no CPU kernel that reads
  fp8/w4a8/nvfp4 weights at memory speed (``torch._scaled_mm`` on CPU takes ~400 ms for a
  4096 x 4096 GEMV; fp8 -> bf16 ``.to()`` runs at ~0.1 G values/s), and its int4 kernel
  (``_weight_int4pack_mm_for_cpu``) reaches ~2/3 of the bandwidth at batch 1 and is slower than
  bf16 at batch 8. ``llk_gemv`` (1-``GEMV_MAX_ROWS`` rows per expert) decodes weights to fp32 in
  registers (table lookups, group scale folded into the table) and uses fp32 FMAs: on these Xeons
  ``vdpbf16ps`` has half the MAC rate of fp32 FMA.
* More rows are MAC-bound on AVX-512 (2 cores). ``llk_amx`` decodes 32 weight rows x 128-256 K
  values at a time to bf16 (exact for every format) into an L1 buffer and multiplies it with all
  activation rows on AMX, fp32 accumulation; group scales that are not exact in bf16 (int4, w4a8)
  are applied to each group's fp32 partial sum. One pass over the weights, whatever the batch.
* Without AMX, many rows go through ``llk_dequant_bf16`` (bf16 weight tiles of
  ``PREFILL_TILE_N`` rows, never the whole matrix) and oneDNN's bf16 GEMM.
* Weights are used exactly as stored (no repacked copy: no extra memory); ``prepare`` caches only
  small things (scales in the dtype the kernel reads, per-expert factors, the C argument block).
  The activations are permuted to the order in which the kernels decode weights, once per call.
* Built once per (source, compiler, flags) into a user cache dir with g++ (~10 s, no torch
  headers). Without a compiler or AVX512-BF16/VBMI, int4 falls back to PyTorch's packed int4
  kernel and the other formats to the reference path (logged once).

Numerics (vs kernels/reference.py), per path:
* gemv and amx: products are exact (fp32 FMA of exact weight values; AMX bf16 x bf16 -> fp32) and
  sums are fp32, so results differ from the reference by fp32 summation order only. Activation
  quantization (fp8 per token, nvfp4 per 16) is bit-identical to the reference's. On the amx path
  a fp32 / fp16 input is split into two bf16 rows (hi + lo: 16 significant bits; the dropped
  remainder is < 2^-16 relative).
* no-AMX prefill path: fp8, w4a8 and nvfp4 weights expand to bf16 exactly; int4 ``q * scale`` is
  rounded to bf16 (<= 2^-9 relative per weight), and the GEMM result is rounded to bf16 before the
  fp32 per-row/per-token/global scales are applied (one more bf16 rounding).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from . import reference
from .formats import (
    Fp8Weight,
    Int4Weight,
    NVFP4Weight,
    W4A8Weight,
    format_name,
    select_expert,
    unpack_int4,
    weight_shape,
)
from .reference import Weight, check_offsets

log = logging.getLogger("llama_lite.kernels")

W_INT4, W_FP4, W_FP8 = 0, 1, 2  # llk.cpp's WeightFormat
S_NONE, S_BF16, S_F32, S_E4M3 = 0, 1, 2, 3  # llk.cpp's ScaleFormat

# Rows of one expert up to which the fp32-FMA GEMV kernel beats AMX, per weight format (measured
# one core, weights in L2: int4 / w4a8 / nvfp4 GEMV ~1.5x AMX at 1 row and ahead at 2; fp8 even at
# 1 row and behind at 2).
GEMV_MAX_ROWS = {W_INT4: 2, W_FP4: 2, W_FP8: 1}
# Activation rows up to which a bf16 weight goes through the C GEMV (vdpbf16ps) rather than oneDNN.
BF16_GEMV_MAX_ROWS = 4
# Without AMX: rows of one expert above which bf16 expansion + oneDNN GEMM beats the GEMV kernel.
PREFILL_ROWS = 16
# Weight rows expanded to bf16 at a time on the prefill path: 1024 x 5120 x 2 B = 10 MiB.
PREFILL_TILE_N = 1024

_CSRC = Path(__file__).parent / "csrc" / "llk.cpp"
_CXXFLAGS = [
    "-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-std=c++17",
    "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vbmi", "-mfma", "-mf16c",
    "-mamx-tile", "-mamx-bf16",
]  # fmt: skip
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512vbmi", "f16c", "fma")
_AMX_FLAGS = ("amx_tile", "amx_bf16")



# ---- building and loading the library


class _Weight(ctypes.Structure):
    _fields_ = [
        ("w", ctypes.c_void_p), ("w_estride", ctypes.c_int64), ("w_ldn", ctypes.c_int64),
        ("s", ctypes.c_void_p), ("s_estride", ctypes.c_int64), ("s_ldn", ctypes.c_int64),
        ("rowscale", ctypes.c_void_p), ("r_estride", ctypes.c_int64), ("alpha", ctypes.c_void_p),
    ]  # fmt: skip


class _Args(ctypes.Structure):
    _fields_ = [
        ("wfmt", ctypes.c_int32), ("sfmt", ctypes.c_int32), ("gs", ctypes.c_int32), ("nthreads", ctypes.c_int32),
        ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("E", ctypes.c_int64),
        ("row_start", ctypes.c_void_p), ("row_end", ctypes.c_void_p),
        ("x", ctypes.c_void_p), ("ldx", ctypes.c_int64), ("tokscale", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("ldo", ctypes.c_int64),
        ("w1", _Weight), ("w3", _Weight),
    ]  # fmt: skip


_lib: Optional[ctypes.CDLL] = None
_lib_tried = False
_lib_lock = threading.Lock()


def _cache_dir() -> Path:
    root = os.environ.get("LLAMA_LITE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "llama_lite"
    )
    return Path(root) / "kernels"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


_amx = False


def amx_available() -> bool:
    """Whether the AMX path is in use (the library is loaded and the OS granted tile state)."""
    return load_library() is not None and _amx


def _compile(cxx: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # build under a temporary name and rename: concurrent processes never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cxx, *_CXXFLAGS, "-o", tmp, str(_CSRC)], check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library() -> Optional[ctypes.CDLL]:
    """The compiled C library, building it on first use; None when it cannot be had here."""
    global _lib, _lib_tried, _amx
    with _lib_lock:
        if _lib_tried:
            return _lib
        _lib_tried = True
        if os.environ.get("LLAMA_LITE_NO_CEXT"):
            log.info("kernels: C++ CPU kernels disabled by LLAMA_LITE_NO_CEXT")
            return None
        flags = _cpu_flags()
        if not all(flag in flags for flag in _CPU_FLAGS):
            log.info("kernels: CPU lacks AVX512-BF16/VBMI; C++ CPU kernels not used")
            return None
        cxx = os.environ.get("CXX", "g++")
        if shutil.which(cxx) is None:
            log.warning("kernels: no C++ compiler (%s) found; CPU fast paths fall back to PyTorch", cxx)
            return None
        try:
            version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
            key = hashlib.sha256((_CSRC.read_text() + " ".join(_CXXFLAGS) + version).encode()).hexdigest()[:16]
            path = _cache_dir() / f"llk-{key}.so"
            if not path.exists():
                log.info("kernels: compiling %s -> %s", _CSRC.name, path)
                _compile(cxx, path)
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.CalledProcessError) as err:
            detail = getattr(err, "stderr", "") or str(err)
            log.warning("kernels: building the C++ CPU kernels failed (%s); falling back to PyTorch", detail[-500:])
            return None
        i64, vp, args = ctypes.c_int64, ctypes.c_void_p, ctypes.POINTER(_Args)
        for name, argtypes, restype in (
            ("llk_abi_version", [], ctypes.c_int),
            ("llk_amx_init", [], ctypes.c_int),
            ("llk_gemv", [args], ctypes.c_int),
            ("llk_amx", [args, i64, i64], ctypes.c_int),
            ("llk_dequant_bf16", [args, i64, i64, i64, vp, i64], ctypes.c_int),
            ("llk_gemv_bf16", [vp, i64, i64, i64, vp, i64, i64, vp, i64, ctypes.c_int], None),
            ("llk_quant_fp8_rows", [vp, i64, i64, i64, ctypes.c_float, vp, vp, i64, vp, ctypes.c_int], None),
            ("llk_quant_nvfp4_rows", [vp, i64, i64, i64, vp, vp, i64, ctypes.c_int], ctypes.c_int),
        ):
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = restype
        # AMX needs the CPU flags and the kernel's permission for the tile state (once per process)
        _amx = all(flag in flags for flag in _AMX_FLAGS) and not os.environ.get("LLAMA_LITE_NO_AMX") and lib.llk_amx_init() == 1
        _lib = lib
        return _lib


def available() -> bool:
    """Whether the C++ fast paths are usable on this machine."""
    return load_library() is not None


# ---- prepared forms


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _per_expert(t: Optional[torch.Tensor], e1: int) -> Optional[torch.Tensor]:
    """A 0-d or [E] fp32 factor as a contiguous fp32 [E] tensor."""
    if t is None:
        return None
    t = t.detach().to(torch.float64)
    return (t.expand(e1) if t.dim() == 0 else t.reshape(e1)).to(torch.float32).contiguous()


def _kernel_layout(w: Weight) -> Optional[tuple[int, int, int]]:
    """(weight format, scale format, group size) of the C kernel for ``w``, or None if unsupported."""
    _, _, k = weight_shape(w)
    if isinstance(w, Fp8Weight):
        return (W_FP8, S_NONE, 0) if w.weight.dtype == torch.float8_e4m3fn else None
    if isinstance(w, NVFP4Weight):
        return (W_FP4, S_E4M3, 16) if w.scales.dtype == torch.float8_e4m3fn and k % 16 == 0 else None
    if isinstance(w, (Int4Weight, W4A8Weight)):
        scales = w.scales if isinstance(w, Int4Weight) else w.group_scales
        sfmt = {torch.bfloat16: S_BF16, torch.float32: S_F32, torch.float16: S_F32, torch.float8_e4m3fn: S_E4M3}
        gs = w.group_size
        if scales.dtype not in sfmt or not (gs in (32, 64) or (gs > 0 and gs % 128 == 0)) or k % gs:
            return None
        return W_INT4, sfmt[scales.dtype], gs
    return None


def _build_cpu_form(w: Weight) -> dict:
    """The cached fast-path form of ``w`` (see ``prepare``)."""
    e, n, k = weight_shape(w)
    e1 = e or 1
    layout = _kernel_layout(w)
    if layout is not None and load_library() is not None:
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
        cw = _Weight(
            _ptr(data), data.stride(0), data.stride(1),
            _ptr(scales), scales.stride(0) if scales is not None else 0, scales.stride(1) if scales is not None else 0,
            _ptr(rowscale), n, _ptr(alpha),
        )  # fmt: skip
        form = dict(
            path="llk", wfmt=wfmt, sfmt=sfmt, gs=gs, e=e1, n=n, k=k, data=data, scales=scales,
            rowscale=rowscale, alpha=alpha, cweight=cw,
        )  # fmt: skip
        if isinstance(w, (Fp8Weight, W4A8Weight)):
            form["act"] = "fp8"
            form["ub"] = w.activation_scale_ub
        elif isinstance(w, NVFP4Weight) and w.input_global_scale is not None:
            form["act"] = "nvfp4"
            form["g_in"] = _per_expert(w.input_global_scale, e1)
        else:
            form["act"] = None
        return form
    if isinstance(w, Int4Weight) and n % 16 == 0 and k % w.group_size == 0 and w.group_size in (32, 64, 128, 256):
        # No C library: PyTorch's packed int4 kernel takes unsigned values with a zero point,
        # w = (u - 8) * scale + zero; u = q + 8 and zero = 0 are our symmetric values exactly.
        packs = []
        for i in range(e1):
            wi = w if e is None else select_expert(w, i)
            u = (unpack_int4(wi.qweight).to(torch.int32) + 8).contiguous()
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
            sz = torch.stack((wi.scales.to(torch.bfloat16).T, torch.zeros_like(wi.scales.T, dtype=torch.bfloat16)), -1)
            packs.append((packed, sz.contiguous()))
        return dict(path="int4pack", e=e1, n=n, k=k, gs=w.group_size, packs=packs)
    return dict(path="reference", e=e1, n=n, k=k)


def prepare(w: Weight, device=None) -> None:
    """Build the CPU fast-path form of ``w`` once and cache it in ``w.prepared["cpu"]``; idempotent."""
    if isinstance(w, torch.Tensor) or "cpu" in w.prepared:
        return
    w.prepared["cpu"] = _build_cpu_form(w)


def _form(w: Weight) -> dict:
    prepare(w)
    return w.prepared["cpu"]


def describe(w: Weight) -> str:
    """Which CPU path ``w`` takes, in words (for the dispatch log line)."""
    if isinstance(w, torch.Tensor):
        return "cpu/torch-matmul"
    path = _form(w)["path"]
    if path == "llk":
        big = "AMX fused dequant-GEMM" if amx_available() else f"bf16 expansion + oneDNN GEMM above {PREFILL_ROWS} rows"
        rows = GEMV_MAX_ROWS[_form(w)["wfmt"]] if amx_available() else PREFILL_ROWS
        return f"cpu/llk: fp32-FMA fused dequant-GEMV up to {rows} rows per expert, {big}"
    if path == "int4pack":
        return "cpu/torch _weight_int4pack_mm_for_cpu"
    return "cpu/reference fallback (no C++ kernel for this layout or machine)"


# ---- activation preparation


_perm_cache: dict[tuple[str, int], torch.Tensor] = {}


def _block_order(order: str, wfmt: int) -> torch.Tensor:
    """K positions of one 64-byte weight block, in the order llk.cpp's decoders produce them."""
    if order == "tile":
        if wfmt == W_FP8:  # z[j] word 8L+t <- 16L+8j+t
            j, lane, t = torch.meshgrid(torch.arange(2), torch.arange(4), torch.arange(8), indexing="ij")
            return (16 * lane + 8 * j + t).flatten()
        # 4-bit: per 16 bytes c, word j <- 32c + 4 (j % 8) + j / 8
        c, j = torch.meshgrid(torch.arange(4), torch.arange(32), indexing="ij")
        return (32 * c + 4 * (j % 8) + j // 8).flatten()
    if wfmt == W_FP8:  # vectors z0.even, z0.odd, z1.even, z1.odd; word w of z[j] <- 16(w/8) + 8j + w%8
        tile = _block_order("tile", W_FP8).view(2, 16, 2)  # [j, pair, even/odd]
        return tile.permute(0, 2, 1).flatten()
    # 4-bit gemv: per 16 bytes c, lo lane i <- 32c + 2 b(i), hi lane i <- 32c + 2 b(i) + 1,
    # b(i) = 4 (i % 4) + i / 4
    c, h, i = torch.meshgrid(torch.arange(4), torch.arange(2), torch.arange(16), indexing="ij")
    return (32 * c + 2 * (4 * (i % 4) + i // 4) + h).flatten()


def _perm(order: str, wfmt: int, k: int) -> torch.Tensor:
    """Gather index [Kp] turning x [.., K] (with a zero column appended at K) into kernel order."""
    key = (order, wfmt, k)
    if key not in _perm_cache:
        blk = _block_order(order, wfmt)
        nblk = -(-k // blk.numel())
        idx = (torch.arange(nblk).unsqueeze(1) * blk.numel() + blk).flatten()
        _perm_cache[key] = torch.where(idx < k, idx, k)
    return _perm_cache[key]


def _permute(x: torch.Tensor, order: str, wfmt: int) -> torch.Tensor:
    """x [T, K] -> contiguous [T, Kp] in kernel order, zero padded, same dtype."""
    perm = _perm(order, wfmt, x.shape[1])
    if perm.numel() == x.shape[1]:  # K fills whole blocks: no padding column needed
        return x.index_select(1, perm)
    return torch.cat((x, x.new_zeros(x.shape[0], 1)), dim=1).index_select(1, perm)


def _split_bf16(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] fp32 -> bf16 [2T, K]: rows 2i and 2i+1 are the hi and lo parts of row i."""
    hi = x.to(torch.bfloat16)
    lo = (x - hi.float()).to(torch.bfloat16)
    return torch.stack((hi, lo), dim=1).reshape(-1, x.shape[1])


def _activations(form: dict, x: torch.Tensor, off: list[int]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The values the weights multiply, fp32 [T, K] in K order, and the per-token scale (fp8) or None.

    Quantized activations come back exactly (e4m3 values; nvfp4 as e2m1 * local scale, the global
    scale being in the weight's alpha).
    """
    lib = load_library()
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


def _args(form: dict, x: torch.Tensor, tokscale, out, starts, ends, form3: Optional[dict]) -> _Args:
    """The C argument block; ``starts`` / ``ends`` are ctypes int64 arrays the caller keeps alive."""
    a = _Args()
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


def _prefill_expert(form: dict, xe: torch.Tensor, e: int, tok: Optional[torch.Tensor]) -> torch.Tensor:
    """fp32 [rows, N] for one expert without AMX: bf16 weight tiles (tile order) times xe with oneDNN."""
    n, kp = form["n"], xe.shape[1]
    out = torch.empty(xe.shape[0], n, dtype=torch.float32)
    buf = torch.empty(min(PREFILL_TILE_N, n), kp, dtype=torch.bfloat16)
    a = _args(form, buf, None, None, None, None, None)
    for n0 in range(0, n, PREFILL_TILE_N):
        n1 = min(n0 + PREFILL_TILE_N, n)
        _check(load_library().llk_dequant_bf16(ctypes.byref(a), e, n0, n1, buf.data_ptr(), kp), "llk_dequant_bf16")
        out[:, n0:n1] = torch.mm(xe, buf[: n1 - n0].T)
    if form["rowscale"] is not None:
        out *= form["rowscale"][e]
    if form["alpha"] is not None:
        out *= form["alpha"][e]
    if tok is not None:
        out *= tok.unsqueeze(1)
    return out


def _run(form: dict, x: torch.Tensor, off: list[int], form3: Optional[dict] = None) -> torch.Tensor:
    """fp32 [T, N] (rows outside off[0]:off[E] zero) for x [T, K] grouped by ``off``.

    With ``form3`` (W3 of a SwiGLU), the result is silu(x W1.T) * (x W3.T).
    """
    lib = load_library()
    e1, n, wfmt = form["e"], form["n"], form["wfmt"]
    t = x.shape[0]
    xa, tok = _activations(form, x, off)
    # every row is written when the experts' rows cover all of x; otherwise the rest must be zero
    out = (torch.empty if off[0] == 0 and off[-1] == t else torch.zeros)(t, n, dtype=torch.float32)
    counts = [b - a for a, b in zip(off, off[1:])]
    use_amx = amx_available()
    limit = GEMV_MAX_ROWS[wfmt] if use_amx else PREFILL_ROWS
    small = [0 < c <= limit for c in counts]
    if any(small):
        starts = _rows_array([off[i] if small[i] else 0 for i in range(e1)])
        ends = _rows_array([off[i + 1] if small[i] else 0 for i in range(e1)])
        xg = _permute(xa, "gemv", wfmt)
        _check(lib.llk_gemv(ctypes.byref(_args(form, xg, tok, out, starts, ends, form3))), "llk_gemv")
    large = [i for i in range(e1) if counts[i] > limit]
    if not large:
        return out
    # bf16 activations in tile order; a fp32 input that is not exactly bf16 goes in as hi + lo rows
    exact = form["act"] is not None or x.dtype == torch.bfloat16
    rep = 1 if exact else 2
    xt = _permute(xa.to(torch.bfloat16) if exact else _split_bf16(xa), "tile", wfmt)
    if use_amx:
        out_t = out if rep == 1 else torch.zeros(t * rep, n, dtype=torch.float32)
        starts = _rows_array([a * rep for a in off[:-1]])
        ends = _rows_array([a * rep for a in off[1:]])
        args = _args(form, xt, tok, out_t, starts, ends, form3)
        for i in large:
            _check(lib.llk_amx(ctypes.byref(args), i, xt.shape[1]), "llk_amx")
        if rep == 2:
            summed = out_t.view(t, 2, n).sum(dim=1)
            for i in large:
                out[off[i] : off[i + 1]] = summed[off[i] : off[i + 1]]
        return out
    for i in large:
        rows = slice(off[i] * rep, off[i + 1] * rep)
        tok_i = tok[off[i] : off[i + 1]] if tok is not None else None
        y = _prefill_expert(form, xt[rows], i, tok_i)
        if form3 is not None:
            y = F.silu(y) * _prefill_expert(form3, xt[rows], i, tok_i)
        out[off[i] : off[i + 1]] = y if rep == 1 else y.view(-1, 2, n).sum(dim=1)
    return out


# ---- int4pack fallback


def _int4pack_rows(form: dict, x: torch.Tensor, e: int) -> torch.Tensor:
    packed, sz = form["packs"][e]
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), packed, form["gs"], sz)


# ---- public functions (same signatures as kernels.reference)


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"activations have {x.shape[-1]} features but the weight expects {k}")
    return x.reshape(-1, k)


def _grouped_fp32(x2: torch.Tensor, off: list[int], w: Weight, form3_w: Optional[Weight] = None) -> torch.Tensor:
    """fp32 [T, N] of x2 [T, K] grouped by ``off`` (one group for a 2-D weight), any path."""
    if isinstance(w, torch.Tensor):
        w3 = w.unsqueeze(0) if w.dim() == 2 else w
        out = torch.zeros(x2.shape[0], w3.shape[1], dtype=torch.float32)
        for i in range(w3.shape[0]):
            if off[i + 1] > off[i]:
                out[off[i] : off[i + 1]] = F.linear(x2[off[i] : off[i + 1]], w3[i].to(x2.dtype)).float()
        return out
    form = _form(w)
    if form["path"] == "llk":
        return _run(form, x2, off)
    out = torch.zeros(x2.shape[0], form["n"], dtype=torch.float32)
    e = weight_shape(w)[0]
    for i in range(form["e"]):
        if off[i + 1] > off[i]:
            rows = x2[off[i] : off[i + 1]]
            if form["path"] == "int4pack":
                out[off[i] : off[i + 1]] = _int4pack_rows(form, rows, i).float()
            else:
                out[off[i] : off[i + 1]] = reference._linear_fp32(rows, w if e is None else select_expert(w, i))
    return out


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
    """x [..., K] @ W.T for bf16 x and W with the C GEMV, or None where it does not apply."""
    n, k = w.shape
    x2 = x.reshape(-1, k)
    lib = load_library()
    if x2.shape[0] > BF16_GEMV_MAX_ROWS or w.stride(1) != 1 or w.device.type != "cpu" or lib is None:
        return None
    x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
    lib.llk_gemv_bf16(w.data_ptr(), w.stride(0), n, k, x2.data_ptr(), k, x2.shape[0], out.data_ptr(), n,
                      torch.get_num_threads())  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x.dtype."""
    if isinstance(w, torch.Tensor) and x.dtype == w.dtype:
        # A few bf16 rows (decode): the C GEMV reads weights at the memory roofline, which
        # oneDNN's bf16 GEMV does not reach at batch 1; more rows: oneDNN's GEMM.
        if w.dtype != torch.bfloat16 or w.dim() != 2:
            return F.linear(x, w)
        out = _gemv_bf16(x, w)
        if out is None:  # oneDNN with the weight as left operand reads it in place (F.linear repacks it)
            x2 = x.reshape(-1, w.shape[1])
            out = (w @ x2.T).T.contiguous().view(*x.shape[:-1], w.shape[0])
        return out
    n, k = _dense(w)
    x2 = _rows(x, k)
    return _grouped_fp32(x2, [0, x2.shape[0]], w).to(x.dtype).reshape(*x.shape[:-1], n)


def grouped_linear(x: torch.Tensor, offsets: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [T, K] with rows offsets[e]:offsets[e+1] for expert e -> [T, N] in x.dtype."""
    e = _experts(w)
    off = check_offsets(offsets, e, x.shape[0])
    return _grouped_fp32(_rows(x, weight_shape(w)[2]), off, w).to(x.dtype)


def _fusable(w1: Weight, w3: Weight, x: torch.Tensor) -> bool:
    """W1 and W3 can run in one kernel call: same layout, same activation quantization."""
    if isinstance(w1, torch.Tensor) or type(w1) is not type(w3) or x.dtype != torch.bfloat16:
        return False
    f1, f3 = _form(w1), _form(w3)
    if f1["path"] != "llk" or f3["path"] != "llk":
        return False
    same = all(f1[key] == f3[key] for key in ("wfmt", "sfmt", "gs", "e", "n", "k", "act"))
    if f1["act"] == "fp8":
        same = same and f1["ub"] == f3["ub"]
    if f1["act"] == "nvfp4":
        same = same and torch.equal(f1["g_in"], f3["g_in"])
    return same


def _swiglu_hidden(x2: torch.Tensor, off: list[int], w1: Weight, w3: Weight) -> torch.Tensor:
    """h = silu(x W1.T) * (x W3.T) from fp32 products, in x.dtype."""
    if _fusable(w1, w3, x2):
        return _run(_form(w1), x2, off, _form(w3)).to(x2.dtype)
    return (F.silu(_grouped_fp32(x2, off, w1)) * _grouped_fp32(x2, off, w3)).to(x2.dtype)


def grouped_swiglu(x: torch.Tensor, offsets: torch.Tensor, w1: Weight, w3: Weight, w2: Weight) -> torch.Tensor:
    """Per expert: (silu(x W1.T) * (x W3.T)) W2.T -> [T, D] in x.dtype.

    W1 and W3 share one activation quantization and one kernel call (two accumulators per row,
    SwiGLU in the epilogue), so h is written once; W2 is a second grouped call.
    """
    e = _experts(w1)
    off = check_offsets(offsets, e, x.shape[0])
    h = _swiglu_hidden(_rows(x, weight_shape(w1)[2]), off, w1, w3)
    return grouped_linear(h, offsets, w2)


def swiglu(x: torch.Tensor, w1: Weight, w3: Weight, w2: Weight) -> torch.Tensor:
    """Dense SwiGLU FFN (the shared expert): (silu(x W1.T) * (x W3.T)) W2.T -> [..., D]."""
    _, k = _dense(w1)
    x2 = _rows(x, k)
    out = linear(_swiglu_hidden(x2, [0, x2.shape[0]], w1, w3), w2)
    return out.reshape(*x.shape[:-1], out.shape[-1])


__all__ = ["linear", "grouped_linear", "grouped_swiglu", "swiglu", "prepare", "available", "describe", "format_name"]
