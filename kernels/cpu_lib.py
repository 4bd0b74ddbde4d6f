"""The CPU libraries behind kernels.cpu: which instruction-set path runs, and building, loading and
calling the C++ libraries of kernels/csrc.

Paths, best first: ``amx``, ``avx512``, ``avx2``, ``none`` (PyTorch only). ``LLAMA_LITE_CPU_ISA``
(or ``set_isa``) caps the choice; the default is the best this CPU has; a cap above what the CPU
has is refused with a ValueError naming what is missing. Each library is built once per (source,
compiler, flags) into a user cache dir with g++ (~10 s, no torch headers); without a compiler
the path in force is ``none``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

log = logging.getLogger("llama_lite.kernels")

W_INT4, W_FP4, W_FP8 = 0, 1, 2  # the libraries' WeightFormat
S_NONE, S_BF16, S_F32, S_E4M3 = 0, 1, 2, 3  # the libraries' ScaleFormat

ISAS = ("amx", "avx512", "avx2", "none")  # best first

_CSRC = Path(__file__).parent / "csrc"
_COMMON_FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-std=c++17"]
_LIBS = {  # library -> (source, compiler flags, CPU flags it needs)
    "avx512": (
        _CSRC / "llk.cpp",
        ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vbmi", "-mfma", "-mf16c",
         "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8"],
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512vbmi", "avx512_vnni", "f16c", "fma"),
    ),
    "avx2": (_CSRC / "llk_avx2.cpp", ["-mavx2", "-mfma", "-mf16c"], ("avx2", "fma", "f16c")),
}  # fmt: skip
_AMX_FLAGS = ("amx_tile", "amx_bf16", "amx_int8")
_ISA_NEEDS = {  # CPU flags each path needs (the avx512 paths also use the AVX2 library)
    "amx": _LIBS["avx512"][2] + _LIBS["avx2"][2] + _AMX_FLAGS,
    "avx512": _LIBS["avx512"][2] + _LIBS["avx2"][2],
    "avx2": _LIBS["avx2"][2],
    "none": (),
}


# ---- which path: the CPU, the cap, the libraries


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=None)
def cpu_isas() -> tuple[str, ...]:
    """The paths this CPU can run, best first; ``none`` (PyTorch only) always."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("none",)
    flags = _cpu_flags()
    return tuple(isa for isa in ISAS if all(f in flags for f in _ISA_NEEDS[isa]))


_isa: Optional[str] = None  # set_isa's choice; None: LLAMA_LITE_CPU_ISA or the best
_lock = threading.RLock()


def _check_isa(name: str) -> str:
    name = name.strip().lower()
    if name not in ISAS:
        raise ValueError(f"unknown CPU path {name!r} (LLAMA_LITE_CPU_ISA); choose one of {', '.join(ISAS)}")
    have = cpu_isas()
    if name not in have:
        missing = sorted(f for f in _ISA_NEEDS[name] if f not in _cpu_flags())
        raise ValueError(
            f"LLAMA_LITE_CPU_ISA={name} needs CPU features this CPU lacks ({', '.join(missing) or platform.machine()}); "
            f"it can run: {', '.join(have)}"
        )
    return name


def set_isa(name: Optional[str]) -> None:
    """Cap the CPU path for every later call (``None``: back to LLAMA_LITE_CPU_ISA or the best)."""
    global _isa
    with _lock:
        _isa = None if name is None else _check_isa(name)


def requested_isa() -> str:
    """The cap asked for: set_isa's, else LLAMA_LITE_CPU_ISA, else the best this CPU has."""
    if _isa is not None:
        return _isa
    env = _read_cap()
    got = _checked_env.get(env)
    if got is None:
        text = env.decode() if isinstance(env, bytes) else env
        got = _checked_env[env] = _check_isa(text) if text.strip() else cpu_isas()[0]
    return got


_checked_env: dict = {}  # LLAMA_LITE_CPU_ISA as read -> the path it asks for
# The environment as os.environ keeps it (bytes on POSIX): the cap is read on every kernel call
# (~350 times per decode step), where os.environ.get costs ~0.8 us and this lookup ~0.05 us.
# os.environ.__setitem__ (and pytest's monkeypatch) write through to it; elsewhere, os.environ.get.
_ENV = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey("LLAMA_LITE_CPU_ISA") if _ENV is not None and hasattr(os.environ, "encodekey") else None


def _read_cap():
    if _ENV_KEY is not None:
        return _ENV.get(_ENV_KEY, b"")
    return os.environ.get("LLAMA_LITE_CPU_ISA", "")


# A cap set in the environment (not by set_isa) caps PyTorch's oneDNN as well, so the whole process
# runs as on a CPU of that kind: on an AMX CPU its bf16 GEMMs would otherwise take AMX tiles whatever
# the cap (15x the avx512 rate on a 512 x 1024 x 4096 GEMM), and "x bf16" would compare with them.
# oneDNN reads ONEDNN_MAX_CPU_ISA at its first GEMM, which comes after this import in the scripts; a
# value the user set is left alone.
_ONEDNN_ISA = {"avx512": "AVX512_CORE_BF16", "avx2": "AVX2"}


def _cap_onednn() -> Optional[str]:
    want = os.environ.get("LLAMA_LITE_CPU_ISA", "").strip().lower()
    if want in _ONEDNN_ISA and not any(k in os.environ for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")):
        os.environ["ONEDNN_MAX_CPU_ISA"] = _ONEDNN_ISA[want]
    return os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")


_onednn_cap = _cap_onednn()


def onednn_cap() -> Optional[str]:
    """The cap on PyTorch's oneDNN (ONEDNN_MAX_CPU_ISA as this module found or set it), or None."""
    return _onednn_cap


_libs: dict[str, Optional[ctypes.CDLL]] = {}
_amx_ok: Optional[bool] = None
_warned: set[str] = set()


def _cache_dir() -> Path:
    root = os.environ.get("LLAMA_LITE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "llama_lite"
    )
    return Path(root) / "kernels"


def _compile(cxx: str, src: Path, flags: list[str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # build under a temporary name and rename: concurrent processes never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cxx, *_COMMON_FLAGS, *flags, "-o", tmp, str(src)], check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL, kind: str) -> None:
    i64, vp, args = ctypes.c_int64, ctypes.c_void_p, ctypes.POINTER(LlkArgs)
    common = [
        ("llk_abi_version", [], ctypes.c_int),
        ("llk_gemv", [args], ctypes.c_int),
        ("llk_gemv_bf16io", [args, vp, i64, i64, vp, i64, vp, i64], ctypes.c_int),
        ("llk_gemv_bf16", [vp, i64, i64, i64, vp, i64, i64, vp, i64, ctypes.c_int], None),
        ("llk_quant_fp8_rows", [vp, i64, i64, i64, ctypes.c_float, vp, vp, i64, vp, ctypes.c_int], None),
        ("llk_quant_nvfp4_rows", [vp, i64, i64, i64, vp, vp, i64, ctypes.c_int], ctypes.c_int),
        ("llk_gather_cols", [vp, i64, i64, i64, vp, i64, vp, ctypes.c_int, ctypes.c_int], ctypes.c_int),
    ]
    own = {
        "avx512": [("llk_amx_init", [], ctypes.c_int), ("llk_amx", [args, i64, i64], ctypes.c_int),
                   ("llk_dpgemm", [args, i64, i64], ctypes.c_int), ("llk_amx_q8", [args, i64], ctypes.c_int),
                   ("llk_dpq8", [args, i64], ctypes.c_int),
                   ("llk_gemv_dp", [args], ctypes.c_int),
                   ("llk_gemv_dp_bf16io", [args, vp, i64, i64, vp, i64, vp, i64], ctypes.c_int),
                   ("llk_gemv_q8", [args], ctypes.c_int),
                   ("llk_gemv_q8_bf16io", [args, vp, i64, i64, vp, i64, vp, i64], ctypes.c_int),
                   ("llk_prefill_attention", [vp, vp, vp, vp, vp, vp, i64, i64, i64, i64, i64, i64, ctypes.c_float, vp,
                                              ctypes.c_int, ctypes.c_int], ctypes.c_int)],
        "avx2": [("llk_gemv_order", [ctypes.c_int, vp], ctypes.c_int), ("llk_gemv_q8", [args], ctypes.c_int),
                 ("llk_gemv_q8_bf16io", [args, vp, i64, i64, vp, i64, vp, i64], ctypes.c_int),
                 ("llk_dequant_f32", [args, i64, i64, i64, vp, i64], ctypes.c_int),
                 ("llk_decode_attention", [vp, vp, vp, vp, vp, i64, i64, i64, i64, i64, ctypes.c_float, vp,
                                           ctypes.c_int, ctypes.c_int], ctypes.c_int),
                 ("llk_decode_step", [vp, vp, vp, vp, vp, vp, vp, i64, vp, vp, i64, i64, i64, i64, ctypes.c_float, vp,
                                      ctypes.c_int, ctypes.c_int], ctypes.c_int),
                 ("llk_rmsnorm_bf16", [vp, i64, vp, vp, i64, i64, i64, ctypes.c_float, ctypes.c_int], ctypes.c_int),
                 ("llk_moe_one_token", [vp, vp, vp, vp], ctypes.c_int),
                 ("llk_moe_one_token_bf16", [vp, vp, vp, vp], ctypes.c_int),
                 ("llk_attention_one_token", [vp, vp, i64, vp, vp, ctypes.c_int, ctypes.c_float, vp], ctypes.c_int),
                 ("llk_block_one_token", [vp, vp, i64, vp, vp, ctypes.c_int, ctypes.c_float, vp], ctypes.c_int),
                 ("llk_blocks_one_token", [vp, i64, vp, i64, vp, vp, vp, vp, vp, vp, vp], ctypes.c_int)],
    }[kind]  # fmt: skip
    for name, argtypes, restype in common + own:
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = restype


def library(kind: str) -> Optional[ctypes.CDLL]:
    """The compiled library ``kind`` (avx512 or avx2), built on first use; None when it cannot be had."""
    with _lock:
        if kind in _libs:
            return _libs[kind]
        _libs[kind] = None
        src, flags, _ = _LIBS[kind]
        cxx = os.environ.get("CXX", "g++")
        if shutil.which(cxx) is None:
            log.warning("kernels: no C++ compiler (%s) found; CPU kernels fall back to PyTorch", cxx)
            return None
        try:
            version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
            sources = src.read_text() + (_CSRC / "llk_common.h").read_text()  # a changed header rebuilds too
            key = hashlib.sha256((sources + " ".join(_COMMON_FLAGS + flags) + version).encode()).hexdigest()[:16]
            path = _cache_dir() / f"{src.stem}-{key}.so"
            if not path.exists():
                log.info("kernels: compiling %s -> %s", src.name, path)
                _compile(cxx, src, flags, path)
            lib = ctypes.CDLL(str(path))
            _declare(lib, kind)
        except (OSError, subprocess.CalledProcessError) as err:
            detail = getattr(err, "stderr", "") or str(err)
            log.warning("kernels: building %s failed (%s); falling back to PyTorch", src.name, detail[-500:])
            return None
        _libs[kind] = lib
        return lib


_resolved: dict[str, str] = {}


def isa() -> str:
    """The CPU path in force: the cap asked for, or ``none`` where its libraries cannot be built."""
    want = requested_isa()
    got = _resolved.get(want)
    if got is None:
        got = _resolved[want] = _resolve(want)
    return got


def _resolve(want: str) -> str:
    global _amx_ok
    if want == "none":
        return "none"
    kinds = ("avx2",) if want == "avx2" else ("avx512", "avx2")
    if any(library(k) is None for k in kinds):
        if want not in _warned:
            _warned.add(want)
            log.warning("kernels: the %s CPU path is unavailable (no compiler or a failed build); using PyTorch", want)
        return "none"
    if want == "amx":
        with _lock:
            if _amx_ok is None:  # the kernel's permission for the tile state, once per process
                _amx_ok = library("avx512").llk_amx_init() == 1
        if not _amx_ok:
            if "amx-perm" not in _warned:
                _warned.add("amx-perm")
                log.warning("kernels: the OS refused the AMX tile state; using the avx512 path")
            return "avx512"
    return want


def available() -> bool:
    """Whether a C++ fast path is in use here (the path in force is not ``none``)."""
    return isa() != "none"


def amx_available() -> bool:
    """Whether the AMX path is in force."""
    return isa() == "amx"


_ONEDNN_BF16 = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10", "DEFAULT", "ALL")


def native_bf16() -> bool:
    """Whether PyTorch's bf16 GEMM has hardware support here (else it is far slower than fp32)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    capped = _onednn_cap is not None and not _onednn_cap.upper().startswith(_ONEDNN_BF16)
    return cpu_isas()[0] in ("amx", "avx512") and not capped


def gemv_lib(path: str) -> ctypes.CDLL:
    return library("avx2" if path == "avx2" else "avx512")


class LlkWeight(ctypes.Structure):
    _fields_ = [
        ("w", ctypes.c_void_p), ("w_estride", ctypes.c_int64), ("w_ldn", ctypes.c_int64),
        ("s", ctypes.c_void_p), ("s_estride", ctypes.c_int64), ("s_ldn", ctypes.c_int64),
        ("rowscale", ctypes.c_void_p), ("r_estride", ctypes.c_int64), ("alpha", ctypes.c_void_p),
    ]  # fmt: skip


class LlkArgs(ctypes.Structure):
    _fields_ = [
        ("wfmt", ctypes.c_int32), ("sfmt", ctypes.c_int32), ("gs", ctypes.c_int32), ("nthreads", ctypes.c_int32),
        ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("E", ctypes.c_int64),
        ("row_start", ctypes.c_void_p), ("row_end", ctypes.c_void_p),
        ("x", ctypes.c_void_p), ("ldx", ctypes.c_int64), ("tokscale", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("ldo", ctypes.c_int64),
        ("w1", LlkWeight), ("w3", LlkWeight), ("out16", ctypes.c_void_p),
    ]  # fmt: skip
