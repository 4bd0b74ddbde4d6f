"""kernels.moe_one_token: a MoE layer for one token (top-1) in one library call, against the same
layer computed as the core computes it at batch 1 (router in PyTorch, ``kernels.grouped_swiglu``
for the routed expert, ``kernels.swiglu`` for the shared one, a bf16 add), under every CPU cap.

The GEMVs are the same calls, so their bits are the same; only the router's fp32 sums are added in
another order, so where a logit lands on a bf16 rounding tie the score (or, on a tie of two
experts, the choice) may differ: the bound below allows a rare such token, not a wrong layer.
"""

import dataclasses
import gc

import pytest
import torch
from torch.nn.functional import silu

import kernels
import quantization
from kernels import cpu, moe
from llama_lite.model import MoE
from quantization.formats import quantize_fp8_rowwise, quantize_int4, quantize_nvfp4, quantize_w4a8

ISAS = cpu.cpu_isas()
E, D, F, FS = 4, 256, 384, 640  # experts, model dim, routed hidden, shared hidden (K of W2 no multiple of 256)


@pytest.fixture(params=ISAS)
def isa(request):
    cpu.set_isa(request.param)
    yield request.param
    cpu.set_isa(None)


def _weights(fmt: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    quant = {
        "int4": quantize_int4, "int4_a8": quantize_int4, "nvfp4": quantize_nvfp4,
        "fp8": quantize_fp8_rowwise, "w4a8": quantize_w4a8,
    }[fmt]  # fmt: skip
    ws = [quant(rand(E, F, D)), quant(rand(E, F, D)), quant(rand(E, D, F)),
          quant(rand(FS, D)), quant(rand(FS, D)), quant(rand(D, FS))]  # fmt: skip
    if fmt == "int4_a8":
        ws = [dataclasses.replace(w, int8_activations=True) for w in ws]
    for w in ws:
        kernels.prepare(w)
    router_ED = torch.randn(E, D, generator=g) * 0.1
    return router_ED, ws


def separate_calls(x, router_ED, w1, w3, w2, s1, s3, s2):
    """MoE._one_token without the one-call hook."""
    logits = torch.mv(router_ED, x[0].float()).to(x.dtype)[None]
    score, expert = torch.topk(logits, 1, dim=-1)
    offsets = (torch.arange(E + 1) > int(expert)).to(torch.long)
    routed = kernels.grouped_swiglu(x * torch.sigmoid(score), offsets, w1, w3, w2)
    out = kernels.swiglu(x, s1, s3, s2)
    out += routed
    return out


def _bf16_weights(seed: int = 0):
    """The layout of the quantized loader's KernelExperts / KernelFeedForward (mode none)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    ws = [rand(E, F, D), rand(E, F, D), rand(E, D, F), rand(FS, D), rand(FS, D), rand(D, FS)]
    return torch.randn(E, D, generator=g) * 0.1, ws


def bf16_separate_calls(x, router_ED, w1, w3, w2, s1, s3, s2):
    """MoE._one_token with KernelExperts and KernelFeedForward, without the one-call hook."""
    logits = torch.mv(router_ED, x[0].float()).to(x.dtype)[None]
    score, expert = torch.topk(logits, 1, dim=-1)
    e, xs = int(expert), x * torch.sigmoid(score)
    routed = kernels.linear(silu(kernels.linear(xs, w1[e])) * kernels.linear(xs, w3[e]), w2[e])
    out = kernels.linear(silu(kernels.linear(x, s1)) * kernels.linear(x, s3), s2)
    out += routed
    return out


def test_bf16_plans_go_with_their_weights():
    router_ED, ws = _bf16_weights(seed=4)
    x = torch.ones(1, D, dtype=torch.bfloat16)
    if cpu.isa() == "none":
        assert kernels.moe_one_token(x, router_ED, *ws) is None
        return
    assert kernels.moe_one_token(x, router_ED, *ws) is not None
    key = id(ws[0])
    assert key in moe._BF16_PLANS
    del ws
    gc.collect()
    assert key not in moe._BF16_PLANS
    _, ws = _bf16_weights()
    assert kernels.moe_one_token(x, router_ED, ws[0][:, :-8], *ws[1:]) is None  # not contiguous
    assert kernels.moe_one_token(x, router_ED, ws[0].float(), *ws[1:]) is None  # fp32
    assert kernels.moe_one_token(x, router_ED, *ws[:5], ws[5][:, :-8].contiguous()) is None  # wrong shape


@pytest.mark.parametrize("fmt", ["int4", "int4_a8", "nvfp4", "bf16"])
def test_matches_the_separate_calls(fmt, isa):
    router_ED, ws = _bf16_weights() if fmt == "bf16" else _weights(fmt)
    reference = bf16_separate_calls if fmt == "bf16" else separate_calls
    xs = (torch.randn(24, 1, D, generator=torch.Generator().manual_seed(1)) * 2).to(torch.bfloat16)
    equal = 0
    for x in xs:
        got = kernels.moe_one_token(x, router_ED, *ws)
        if isa == "none":
            assert got is None  # PyTorch only: the caller's own path
            continue
        want = reference(x, router_ED, *ws)
        assert got.shape == want.shape == (1, D) and got.dtype == torch.bfloat16
        equal += torch.equal(got, want)
        torch.testing.assert_close(got, want, rtol=0, atol=2**-6 * float(want.abs().max()))
    assert isa == "none" or equal >= len(xs) - 2, equal


def test_threads_and_a_replaced_router_get_their_own_plan(isa):
    router_ED, ws = _weights("int4", seed=2)
    x = (torch.randn(1, D, generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16)
    if isa == "none":
        assert kernels.moe_one_token(x, router_ED, *ws) is None
        return
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.moe_one_token(x, router_ED, *ws)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, kernels.moe_one_token(x, router_ED, *ws), rtol=0, atol=0)
    flipped = router_ED.flip(0).contiguous()  # another router: another expert for most tokens
    torch.testing.assert_close(kernels.moe_one_token(x, flipped, *ws), separate_calls(x, flipped, *ws),
                               rtol=0, atol=2**-6 * float(one.abs().max()))


@pytest.mark.parametrize("fmt", ["fp8", "w4a8"])
def test_declines_what_it_does_not_compute(fmt):
    router_ED, ws = _weights(fmt)
    x = torch.ones(1, D, dtype=torch.bfloat16)
    assert kernels.moe_one_token(x, router_ED, *ws) is None  # fp8-quantized activations: not in this call
    router_ED, ws = _weights("int4")
    assert kernels.moe_one_token(torch.ones(2, D, dtype=torch.bfloat16), router_ED, *ws) is None  # two tokens
    assert kernels.moe_one_token(x.float(), router_ED, *ws) is None  # fp32 activations
    assert kernels.moe_one_token(x, router_ED.to(torch.bfloat16), *ws) is None  # a bf16 router
    assert kernels.moe_one_token(torch.ones(1, D + 8, dtype=torch.bfloat16), router_ED, *ws) is None  # wrong width
    assert kernels.moe_one_token(x, router_ED[:2].contiguous(), *ws) is None  # a router for other experts


@pytest.mark.parametrize("mode", ["int4_mixed", "none"])
def test_the_quantized_loader_decodes_each_moe_layer_in_one_call(mode, tiny_ckpt, dist1, monkeypatch):
    llama = quantization.build(tiny_ckpt, mode, max_seq_len=64, max_batch_size=1, progress=False)
    model = llama.model
    model.one_token_impl = None  # the MoE layer's own call (test_block_layer.py: the blocks')
    for block in model.layers:
        block.one_token_impl = None
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers and all(m.one_token_impl is not None for m in layers)
    calls = []
    real = kernels.moe_one_token
    monkeypatch.setattr(kernels, "moe_one_token", lambda *a: calls.append(1) or real(*a))
    prompt, nxt = torch.tensor([[1, 500, 1000, 1500, 2000]]), [42, 7, 99, 1234, 5, 600, 3, 8]

    def decode():
        model.setup_caches()
        with torch.inference_mode():
            model(prompt, 0)
            return torch.cat([model(torch.tensor([[t]]), prompt.shape[1] + i)[:, -1] for i, t in enumerate(nxt)])

    got = decode()
    assert len(calls) == len(nxt) * len(layers)  # every decode step of every MoE layer, none in prefill
    for m in layers:
        m.one_token_impl = None
    want = decode()
    assert len(calls) == len(nxt) * len(layers)
    torch.testing.assert_close(got, want, rtol=0, atol=2**-6 * float(want.abs().max()))
    assert torch.equal(got.argmax(-1), want.argmax(-1))
