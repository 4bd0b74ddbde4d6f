"""The kernels as PyTorch custom operators, so that ``torch.compile`` traces through them.

``torch.ops.llama_lite_kernels.{linear, grouped_linear, grouped_swiglu, swiglu}``
take a weight as the tensors of its container plus a short spec string (the format and its
scalar fields, e.g. ``Int4Weight|group_size=128|qweight,scales``): no Python object enters a
graph. Each op runs ``kernels.dispatch``'s function on the container those tensors belong to,
so every backend (reference, CPU paths, Triton) and every prepared form is the one eager code
uses. Fake (meta) implementations give the output shapes for tracing. ``kernels.entry`` calls
them while ``torch.compile`` traces.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import torch

from . import dispatch, formats
from .formats import Fp8Weight, Int4Weight, NVFP4Weight, W4A8Weight

_KINDS = {cls.__name__: cls for cls in (Int4Weight, Fp8Weight, W4A8Weight, NVFP4Weight)}

# Containers by (spec, data pointers of their tensors): the op finds the container, and with it the
# forms ``prepare`` cached, from the tensors it is given. Weak: a dropped model drops its entries.
_containers: "weakref.WeakValueDictionary[tuple, object]" = weakref.WeakValueDictionary()


def _fields(w) -> tuple[list[torch.Tensor], str]:
    """(tensors, spec) of a container or a plain tensor (spec "tensor")."""
    if isinstance(w, torch.Tensor):
        return [w], "tensor"
    tensors, names, scalars = [], [], []
    for f in dataclasses.fields(w):
        if f.name == "prepared":
            continue
        value = getattr(w, f.name)
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            names.append(f.name)
        elif value is not None:
            scalars.append(f"{f.name}={value!r}")
    return tensors, "|".join([type(w).__name__, ",".join(scalars), ",".join(names)])


def _key(tensors: list[torch.Tensor], spec: str) -> tuple:
    return (spec,) + tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors)


def register(w) -> None:
    """Let the ops find ``w`` (and its prepared forms) from its tensors; ``prepare`` calls this."""
    if not isinstance(w, torch.Tensor):
        tensors, spec = _fields(w)
        _containers[_key(tensors, spec)] = w


def weight_args(w) -> tuple[list[torch.Tensor], str]:
    """The op arguments standing for weight ``w``."""
    return _fields(w)


def _weight(tensors: list[torch.Tensor], spec: str):
    """The container (or tensor) that ``weight_args`` turned into ``tensors`` and ``spec``."""
    if spec == "tensor":
        return tensors[0]
    key = _key(tensors, spec)
    w = _containers.get(key)
    if w is None:  # never registered (or its registration was dropped): rebuild it; cached from now on
        kind, scalars, names = spec.split("|")
        kwargs = dict(zip(names.split(","), tensors))
        for item in filter(None, scalars.split(",")):
            name, value = item.split("=", 1)
            if value in ("True", "False"):
                kwargs[name] = value == "True"
            else:
                kwargs[name] = int(value) if value.lstrip("-").isdigit() else float(value)
        w = _KINDS[kind](**kwargs)
        _containers[key] = w
    return w


def _n(tensors: list[torch.Tensor]) -> int:
    return tensors[0].shape[-2]  # every format stores [..., N, K or K/2] first


# ---- the operators


@torch.library.custom_op("llama_lite_kernels::linear", mutates_args=())
def linear_op(x: torch.Tensor, w: list[torch.Tensor], spec: str) -> torch.Tensor:
    return dispatch.linear(x, _weight(w, spec))


@linear_op.register_fake
def _(x, w, spec):
    return x.new_empty(*x.shape[:-1], _n(w))


@torch.library.custom_op("llama_lite_kernels::grouped_linear", mutates_args=())
def grouped_linear_op(x: torch.Tensor, offsets: torch.Tensor, w: list[torch.Tensor], spec: str) -> torch.Tensor:
    return dispatch.grouped_linear(x, offsets, _weight(w, spec))


@grouped_linear_op.register_fake
def _(x, offsets, w, spec):
    return x.new_empty(x.shape[0], _n(w))


@torch.library.custom_op("llama_lite_kernels::grouped_swiglu", mutates_args=())
def grouped_swiglu_op(x: torch.Tensor, offsets: torch.Tensor, w1: list[torch.Tensor], w3: list[torch.Tensor],
                      w2: list[torch.Tensor], spec1: str, spec3: str, spec2: str) -> torch.Tensor:
    return dispatch.grouped_swiglu(x, offsets, _weight(w1, spec1), _weight(w3, spec3), _weight(w2, spec2))


@grouped_swiglu_op.register_fake
def _(x, offsets, w1, w3, w2, spec1, spec3, spec2):
    return x.new_empty(x.shape[0], _n(w2))


@torch.library.custom_op("llama_lite_kernels::swiglu", mutates_args=())
def swiglu_op(x: torch.Tensor, w1: list[torch.Tensor], w3: list[torch.Tensor], w2: list[torch.Tensor],
              spec1: str, spec3: str, spec2: str) -> torch.Tensor:
    return dispatch.swiglu(x, _weight(w1, spec1), _weight(w3, spec3), _weight(w2, spec2))


@swiglu_op.register_fake
def _(x, w1, w3, w2, spec1, spec3, spec2):
    return x.new_empty(*x.shape[:-1], _n(w2))


# ---- callers (what kernels.entry's functions use while compiling)


def linear(x: torch.Tensor, w) -> torch.Tensor:
    t, s = weight_args(w)
    return linear_op(x, t, s)


def grouped_linear(x: torch.Tensor, offsets: torch.Tensor, w) -> torch.Tensor:
    t, s = weight_args(w)
    return grouped_linear_op(x, offsets, t, s)


def grouped_swiglu(x: torch.Tensor, offsets: torch.Tensor, w1, w3, w2) -> torch.Tensor:
    (t1, s1), (t3, s3), (t2, s2) = weight_args(w1), weight_args(w3), weight_args(w2)
    return grouped_swiglu_op(x, offsets, t1, t3, t2, s1, s3, s2)


def swiglu(x: torch.Tensor, w1, w3, w2) -> torch.Tensor:
    (t1, s1), (t3, s3), (t2, s2) = weight_args(w1), weight_args(w3), weight_args(w2)
    return swiglu_op(x, t1, t3, t2, s1, s3, s2)


def container_of(tensors: list[torch.Tensor], spec: str) -> Optional[object]:
    """The registered container for these op arguments, or None (for tests)."""
    return _containers.get(_key(tensors, spec))
