"""Pick the implementation of each kernel call: reference, CPU fast path or Triton.

``auto`` (the default) uses Triton for CUDA tensors when ``kernels.triton_kernels`` imports,
the CPU fast paths (``kernels.cpu``, under the CPU cap ``LLAMA_LITE_CPU_ISA``) for CPU tensors, and
the reference otherwise. The choice can be forced with ``set_backend`` or the ``LLAMA_LITE_KERNELS``
environment variable. The first call for each (operation, format, path) logs one line on
``llama_lite.kernels`` naming the path, e.g. ``cpu/avx2: fp32-FMA fused dequant-GEMV ...``.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Optional

import torch

from . import cpu, reference
from .formats import format_name

log = logging.getLogger("llama_lite.kernels")

BACKENDS = ("auto", "reference", "cpu", "triton")

_backend: Optional[str] = None  # None: read LLAMA_LITE_KERNELS on first use
_triton: Optional[ModuleType] = None
_triton_error: Optional[str] = None
_logged: set[tuple[str, str, str]] = set()


def _check(name: str) -> str:
    name = name.strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return name


def set_backend(name: str) -> None:
    """Use ``name`` (auto, reference, cpu or triton) for every later kernel call."""
    global _backend
    _backend = _check(name)
    _logged.clear()


def get_backend() -> str:
    """The backend in force: set_backend's, else LLAMA_LITE_KERNELS, else auto."""
    global _backend
    if _backend is None:
        _backend = _check(os.environ.get("LLAMA_LITE_KERNELS", "auto"))
    return _backend


def _triton_module() -> Optional[ModuleType]:
    """kernels.triton_kernels, imported on first need; None (reason kept) when it cannot be."""
    global _triton, _triton_error
    if _triton is None and _triton_error is None:
        try:
            _triton = importlib.import_module(".triton_kernels", __package__)
        except Exception as err:  # noqa: BLE001 -- no triton, no GPU toolchain, or a broken module
            _triton_error = f"{type(err).__name__}: {err}"
    return _triton


def _select(x: torch.Tensor) -> tuple[ModuleType, str]:
    """(module, name) of the implementation for activations ``x``."""
    backend = get_backend()
    if backend == "reference":
        return reference, "reference"
    if backend == "cpu":
        if x.device.type != "cpu":
            raise ValueError(f"kernel backend 'cpu' needs CPU tensors, got a tensor on {x.device}")
        return cpu, "cpu"
    if backend == "triton":
        module = _triton_module()
        if module is None:
            raise RuntimeError(f"kernel backend 'triton' is not available here ({_triton_error})")
        return module, "triton"
    if x.is_cuda:
        module = _triton_module()
        return (module, "triton") if module is not None else (reference, "reference")
    if x.device.type == "cpu":
        return cpu, "cpu"
    return reference, "reference"


def _choose(x: torch.Tensor, w) -> tuple[ModuleType, str]:
    """``_select``, except that the Triton kernels have no int8-activation form (a CPU option):
    such weights take the reference on a GPU."""
    module, path = _select(x)
    if path == "triton" and getattr(w, "int8_activations", False):
        return reference, "reference"
    return module, path


def _note(op: str, w, path: str) -> None:
    if path == "cpu":
        path = f"cpu/{cpu.isa()}"  # a new CPU cap (LLAMA_LITE_CPU_ISA, cpu.set_isa) logs again
    key = (op, format_name(w), path)
    if key not in _logged:
        _logged.add(key)
        detail = cpu.describe(w) if path.startswith("cpu") else path
        if path == "reference" and _triton_error and get_backend() == "auto":
            detail += f" (triton unavailable: {_triton_error})"
        log.info("kernels: %s %s -> %s", op, format_name(w), detail)


def prepare(w, device: Optional[torch.device | str] = None) -> None:
    """Build and cache the fast-path form of ``w`` for ``device`` (default: where ``w`` lives), once.

    Call at load time; later calls are no-ops. Plain tensors need nothing.
    """
    if isinstance(w, torch.Tensor):
        return
    data = getattr(w, "qweight", None)
    if data is None:
        data = w.weight
    dev = torch.device(device) if device is not None else data.device
    backend = get_backend()
    if dev.type == "cpu" and backend in ("auto", "cpu"):
        cpu.prepare(w)
    elif dev.type == "cuda" and backend in ("auto", "triton"):
        module = _triton_module()
        if module is not None and hasattr(module, "prepare"):
            module.prepare(w, dev)


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x.dtype, for any weight format (or a plain tensor)."""
    module, path = _choose(x, w)
    _note("linear", w, path)
    return module.linear(x, w)


def grouped_linear(x: torch.Tensor, offsets: torch.Tensor, w) -> torch.Tensor:
    """Rows offsets[e]:offsets[e+1] of x [T, K] times expert e of w [E, N, K] -> [T, N]."""
    module, path = _choose(x, w)
    _note("grouped_linear", w, path)
    return module.grouped_linear(x, offsets, w)


def grouped_swiglu(x: torch.Tensor, offsets: torch.Tensor, w1, w3, w2) -> torch.Tensor:
    """Per expert: (silu(x W1.T) * (x W3.T)) W2.T on its rows -> [T, D]."""
    module, path = _choose(x, w1)
    _note("grouped_swiglu", w1, path)
    return module.grouped_swiglu(x, offsets, w1, w3, w2)


def swiglu(x: torch.Tensor, w1, w3, w2) -> torch.Tensor:
    """Dense SwiGLU FFN (shared expert): (silu(x W1.T) * (x W3.T)) W2.T -> [..., D]."""
    module, path = _choose(x, w1)
    _note("swiglu", w1, path)
    return module.swiglu(x, w1, w3, w2)
