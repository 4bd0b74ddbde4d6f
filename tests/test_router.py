"""The MoE router's logits (``MoE.router_logits``): an fp32 product on a cached fp32 copy of the
router, which must equal the bf16 matmul up to summation order and follow the weight when it changes.
And one token's top-1 route (``MoE._one_token``), which must give the general route's bits."""

import pytest
import torch

from llama_lite.args import ModelArgs, MoEArgs
from llama_lite.model import MoE


def _moe(dim=320, experts=16, seed=0):
    torch.manual_seed(seed)
    args = ModelArgs(dim=dim, n_layers=1, n_heads=4, vocab_size=64, moe_args=MoEArgs(num_experts=experts, top_k=1), moe_hidden_dim=64)
    moe = MoE(args).to(torch.bfloat16)
    with torch.no_grad():
        moe.router_DE.copy_(torch.randn(dim, experts) * dim**-0.5)
    return moe


def _within_an_ulp(got, x, w) -> bool:
    """got within one bf16 ulp of the exact product x @ w (fp32 summation order may tip a rounding)."""
    want = (x.double() @ w.double()).to(torch.bfloat16).float()
    ulp = want.abs().clamp_min(2.0**-126) * 2.0**-7
    return bool(((got.float() - want).abs() <= ulp).all())


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_router_logits_are_the_rounded_product(rows, dist1):
    moe = _moe()
    x = torch.randn(rows, 320, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = moe.router_logits(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 16)
    assert _within_an_ulp(got, x, moe.router_DE.detach())


def test_router_logits_follow_a_changed_weight(dist1):
    moe = _moe()
    x = torch.randn(1, 320, dtype=torch.bfloat16)
    with torch.inference_mode():
        before = moe.router_logits(x).clone()
    other = _moe(seed=1).router_DE.detach().clone()
    moe.load_state_dict({**moe.state_dict(), "router_DE": other})  # written in place: same storage
    with torch.inference_mode():
        after = moe.router_logits(x)
    assert not torch.equal(before, after)
    assert _within_an_ulp(after, x, other)
    moe.router_DE = torch.nn.Parameter(torch.zeros(320, 16, dtype=torch.bfloat16))  # replaced
    with torch.inference_mode():
        assert bool((moe.router_logits(x) == 0).all())


def _general_route(moe, x_aD):
    """MoE.forward as it routes many tokens (sort, search, gather, indexed add), written out."""
    token_T, score_T, offsets = moe.route(x_aD)
    routed_TD = moe.experts(x_aD[token_T] * score_T.unsqueeze(-1), offsets)
    out_aD = moe.shared_expert(x_aD)
    return out_aD.index_add_(0, token_T, routed_TD)


def test_one_token_takes_the_general_routes_values(dist1):
    moe = _moe()
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if name != "router_DE":
                p.copy_(torch.randn(p.shape) * 0.1)
    experts = set()
    with torch.inference_mode():
        for _ in range(24):
            x = torch.randn(1, 1, 320, dtype=torch.bfloat16)
            got = moe(x)
            assert got.shape == x.shape
            assert torch.equal(got.view(1, -1), _general_route(moe, x.view(1, -1)))
            experts.add(int(moe.router_logits(x.view(1, -1)).argmax()))
    assert len(experts) >= 4  # the offsets kept for several experts, each right
