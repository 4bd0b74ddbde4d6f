"""kernels.ops: every public kernel as a torch custom operator that torch.compile traces whole.

A function calling linear / grouped_linear / grouped_swiglu / swiglu, compiled with
fullgraph=True (any graph break fails), gives exactly the eager numbers: the operators run the
same kernels on the same containers (with their prepared forms) that eager calls use.
"""

import pytest
import torch

import kernels
from kernels import ops
from kernels.formats import weight_shape

from test_cpu import FORMATS

D, F_, E = 128, 256, 4
FORMAT_NAMES = [*FORMATS, "bf16"]


def weights(fmt: str):
    """(w1, w3, w2) expert weights [E, F, D] / [E, D, F] and a dense [F, D] one, in ``fmt``."""
    if fmt == "bf16":
        g = torch.Generator().manual_seed(0)
        make = lambda *shape: (torch.randn(*shape, generator=g) / 8).to(torch.bfloat16)  # noqa: E731
        return make(E, F_, D), make(E, F_, D), make(E, D, F_), make(F_, D), make(D, F_)
    build = FORMATS[fmt]
    return (build(F_, D, lead=(E,), seed=1), build(F_, D, lead=(E,), seed=2), build(D, F_, lead=(E,), seed=3),
            build(F_, D, seed=4), build(D, F_, seed=5))  # fmt: skip


def step(x, offsets, w1, w3, w2, d1, d2):
    """What a decode step asks of the kernels, plus glue that inductor fuses around them."""
    h = kernels.linear(x * 2.0, d1)
    dense = kernels.swiglu(x, d1, d1, d2)
    routed = kernels.grouped_swiglu(x, offsets, w1, w3, w2)
    lin = kernels.grouped_linear(h, offsets, w2)
    return (dense + routed).float() + lin.float() * 0.5


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_compiled_fullgraph_equals_eager(fmt):
    """inductor for two formats; the others through aot_eager (the same tracing and fake shapes,
    without inductor's few seconds of C++ compilation per graph)."""
    torch._dynamo.reset()
    backend = "inductor" if fmt in ("int4", "bf16") else "aot_eager"
    w1, w3, w2, d1, d2 = weights(fmt)
    for w in (w1, w3, w2, d1, d2):
        kernels.prepare(w)
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    offsets = torch.tensor([0, 2, 2, 4, 5])  # an empty expert, and one with two rows
    eager = step(x, offsets, w1, w3, w2, d1, d2)
    # emulate_precision_casts: the glue rounds to bf16 where eager does (as Transformer.compile_decode)
    options = {"emulate_precision_casts": True} if backend == "inductor" else None
    compiled = torch.compile(step, fullgraph=True, backend=backend, options=options)(x, offsets, w1, w3, w2, d1, d2)
    assert eager.isfinite().all() and eager.abs().max() > 0
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", [f for f in FORMAT_NAMES if f != "bf16"])
def test_ops_find_the_prepared_container_or_rebuild_it(fmt):
    w1 = weights(fmt)[3]
    tensors, spec = ops.weight_args(w1)
    assert ops.container_of(tensors, spec) is None  # not registered before prepare
    kernels.prepare(w1)
    assert ops.container_of(tensors, spec) is w1
    assert ops._weight(tensors, spec) is w1  # the op reuses its prepared forms

    fresh = weights(fmt)[3]  # same values, new tensors, never prepared: rebuilt from its fields
    t2, s2 = ops.weight_args(fresh)
    rebuilt = ops._weight(t2, s2)
    assert type(rebuilt) is type(fresh) and rebuilt is not fresh
    for name in vars(fresh):
        if name != "prepared":
            a, b = getattr(fresh, name), getattr(rebuilt, name)
            assert (a is b) if isinstance(a, torch.Tensor) else a == b
    x = torch.randn(3, D).to(torch.bfloat16)
    torch.testing.assert_close(ops.linear_op(x, t2, s2), kernels.linear(x, fresh), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["int4", "nvfp4_w4a4", "bf16"])
def test_fake_implementations_give_the_shapes(fmt):
    w1, w3, w2, d1, d2 = weights(fmt)
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(7, D).to(torch.bfloat16)
    offsets = torch.tensor([0, 3, 3, 7, 7])
    real = {
        "linear": kernels.linear(x, d1), "swiglu": kernels.swiglu(x, d1, d1, d2),
        "grouped_linear": kernels.grouped_linear(x, offsets, w1),
        "grouped_swiglu": kernels.grouped_swiglu(x, offsets, w1, w3, w2),
    }  # fmt: skip
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = {
            "linear": ops.linear(x, d1), "swiglu": ops.swiglu(x, d1, d1, d2),
            "grouped_linear": ops.grouped_linear(x, offsets, w1),
            "grouped_swiglu": ops.grouped_swiglu(x, offsets, w1, w3, w2),
        }  # fmt: skip
    for name, out in real.items():
        assert fake[name].shape == out.shape and fake[name].dtype == out.dtype, name
    assert real["grouped_linear"].shape == (7, weight_shape(w1)[1])
