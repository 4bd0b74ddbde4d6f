"""kernels.rmsnorm: the core's RMSNorm (``rmsnorm(x, eps) * weight``) in one library call.

Same fp32 operations and the same two roundings to bf16 as the core; only the sum of squares is
added in another order, so an element may come out one bf16 ulp apart where its value lands on a
rounding tie (none did on these inputs; the bound below allows a rare one).
"""

import pytest
import torch

import kernels
import quantization
from kernels import cpu
from llama_lite.model import Attention, RMSNorm, rmsnorm as core_rmsnorm

ISAS = cpu.cpu_isas()
# (rows..., dim): a decode row of the bench preset, the query/key heads of one token, Scout's dim,
# more rows than the kernel's threading threshold, and dims that are no multiple of 8 or 32
SHAPES = [(1, 1, 2048), (1, 1, 20, 128), (2, 3, 5120), (40, 256), (3, 100), (2, 7), (1, 1, 1)]


@pytest.fixture(params=ISAS)
def isa(request):
    cpu.set_isa(request.param)
    yield request.param
    cpu.set_isa(None)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the last place of bf16, element by element (same sign assumed)."""
    ia, ib = a.view(torch.int16).to(torch.int32), b.view(torch.int16).to(torch.int32)
    return (ia - ib).abs()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "bare"])
def test_matches_the_core(shape, weighted, isa):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(torch.bfloat16)
    x.view(-1)[0] = 40.0  # one large value: the scale is not ~1
    w = (torch.randn(shape[-1], generator=g) + 1).to(torch.bfloat16) if weighted else None
    want = core_rmsnorm(x, 1e-5) if w is None else core_rmsnorm(x, 1e-5) * w
    got = kernels.rmsnorm(x, w, 1e-5)
    if isa == "none":
        assert got is None  # PyTorch only: the core computes it
        return
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    apart = ulps_apart(got, want)
    assert int(apart.max()) <= 1 and int((apart > 0).sum()) <= max(1, want.numel() // 1000), apart.max()


def test_an_epsilon_and_a_zero_row(isa):
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    x[1] = 1e-4
    for eps in (1e-5, 1e-2):
        got = kernels.rmsnorm(x, None, eps)
        if isa != "none":
            assert torch.equal(got, core_rmsnorm(x, eps))  # zeros stay zeros; eps counts at small values


def test_declines_what_it_does_not_compute():
    x = torch.randn(4, 64).to(torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    assert kernels.rmsnorm(x.float(), None, 1e-5) is None  # fp32 activations
    assert kernels.rmsnorm(x, w.float(), 1e-5) is None  # an fp32 weight
    assert kernels.rmsnorm(x, torch.ones(32, dtype=torch.bfloat16), 1e-5) is None  # a weight of another size
    assert kernels.rmsnorm(x.t(), None, 1e-5) is None  # features not contiguous
    assert kernels.rmsnorm(x[:, ::2], None, 1e-5) is None


def test_the_quantized_loader_runs_every_norm_through_it(tiny_ckpt, dist1):
    llama = quantization.build(tiny_ckpt, "int4_mixed", max_seq_len=32, max_batch_size=1, progress=False)
    model = llama.model
    assert model.norm.weight.dtype == torch.bfloat16  # the kernel applies (it declines fp32)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    heads = [m for m in model.modules() if isinstance(m, Attention)]
    assert norms and all(m.impl is kernels.rmsnorm for m in norms)
    assert heads and all(m.norm_impl is kernels.rmsnorm for m in heads)
    tokens = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.inference_mode():
        got = model(tokens, 0)
        for m in norms:
            m.impl = None
        for m in heads:
            m.norm_impl = None
        want = model(tokens, 0)
    # the same operations (the sums of squares in another order): equal logits on this input
    torch.testing.assert_close(got, want, rtol=0, atol=2**-7 * float(want.abs().max()))
