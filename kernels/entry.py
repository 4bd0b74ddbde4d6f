"""The public kernel calls: ``kernels.dispatch``'s eager functions, or, while ``torch.compile``
traces (``torch.compiler.is_compiling``), the same computation as an opaque operator of
``kernels.ops`` (eager calls skip the operator dispatcher's few microseconds per call at decode)."""

from __future__ import annotations

from typing import Optional

import torch

from . import dispatch, ops


def prepare(w, device: Optional[torch.device | str] = None) -> None:
    """Build and cache the fast-path form of ``w`` for ``device`` (default: where ``w`` lives), once,
    and let the operators find ``w`` from its tensors.

    Call at load time; later calls are no-ops. Plain tensors need nothing.
    """
    if isinstance(w, torch.Tensor):
        return
    ops.register(w)
    dispatch.prepare(w, device)


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x.dtype, for any weight format (or a plain tensor)."""
    if torch.compiler.is_compiling():
        return ops.linear(x, w)
    return dispatch.linear(x, w)


def grouped_linear(x: torch.Tensor, offsets: torch.Tensor, w) -> torch.Tensor:
    """Rows offsets[e]:offsets[e+1] of x [T, K] times expert e of w [E, N, K] -> [T, N]."""
    if torch.compiler.is_compiling():
        return ops.grouped_linear(x, offsets, w)
    return dispatch.grouped_linear(x, offsets, w)


def grouped_swiglu(x: torch.Tensor, offsets: torch.Tensor, w1, w3, w2) -> torch.Tensor:
    """Per expert: (silu(x W1.T) * (x W3.T)) W2.T on its rows -> [T, D]."""
    if torch.compiler.is_compiling():
        return ops.grouped_swiglu(x, offsets, w1, w3, w2)
    return dispatch.grouped_swiglu(x, offsets, w1, w3, w2)


def swiglu(x: torch.Tensor, w1, w3, w2) -> torch.Tensor:
    """Dense SwiGLU FFN (shared expert): (silu(x W1.T) * (x W3.T)) W2.T -> [..., D]."""
    if torch.compiler.is_compiling():
        return ops.swiglu(x, w1, w3, w2)
    return dispatch.swiglu(x, w1, w3, w2)
