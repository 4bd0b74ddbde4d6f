"""kernels.one_token_block: a decoder block's decode step for one token in one library call, against
the same block computed by the separate calls it replaces (the norms' ``kernels.rmsnorm``, the
one-call attention and MoE layers, the core's bf16 residual adds), under every CPU cap, on both
cache layouts, across chunk boundaries.

The library runs the very functions of the separate calls and adds as PyTorch does (fp32 sum, one
rounding to bf16), so logits and caches must be bit-equal: any difference is a bug.
"""

import pytest
import torch

import kernels
import quantization
from kernels import block_layer, cpu

from one_call import PROMPT, check_against_separate_calls

ISAS = cpu.cpu_isas()


@pytest.fixture(scope="module", params=[("none", None), ("int4_mixed", None), ("int4_mixed", "all")],
                ids=["bf16", "int4_mixed", "int4_all"])  # fmt: skip
def built(request, tiny_ckpt, dist1):
    mode, targets = request.param
    return quantization.build(tiny_ckpt, mode, targets=targets, max_seq_len=64, max_batch_size=1, progress=False)


@pytest.fixture
def counted(monkeypatch):
    """[taken, declined]: the one-call block's calls."""
    n = [0, 0]
    real = kernels.one_token_block

    def call(*args):
        out = real(*args)
        n[out is None] += 1
        return out

    monkeypatch.setattr(kernels, "one_token_block", call)
    return n


@pytest.mark.parametrize("layout", ["by_kind", "full"])
@pytest.mark.parametrize("isa", ISAS)
def test_matches_the_separate_calls(built, layout, isa, counted):
    model = built.model
    blocks = list(model.layers)
    assert blocks and all(b.one_token_impl is not None for b in blocks)
    assert any(b.attention.temperature_tuning for b in blocks) and any(b.attention.use_rope for b in blocks)
    check_against_separate_calls(model, blocks, layout, isa, counted, cpu)


def test_declines_what_its_layers_decline(tiny_ckpt, dist1, counted):
    # fp8 activations are quantized in PyTorch: no one-call attention or MoE layer, so no block call
    fp8 = quantization.build(tiny_ckpt, "fp8_mixed", targets="all", max_seq_len=64, max_batch_size=1, progress=False)
    with torch.inference_mode():
        fp8.model(PROMPT, 0)
        fp8.model(torch.tensor([[4]]), PROMPT.shape[1])
    n = sum(b.one_token_impl is not None for b in fp8.model.layers)
    assert n > 0 and counted == [0, n]
    counted[:] = [0, 0]
    # an fp8 KV cache: the attention layer declines, so the block does, and the separate path runs
    bf16 = quantization.build(tiny_ckpt, "none", max_seq_len=64, max_batch_size=2, progress=False)
    model = bf16.model
    assert all(b.one_token_impl is not None for b in model.layers)
    model.setup_caches(dtype=torch.float8_e4m3fn)
    with torch.inference_mode():
        model(PROMPT, 0)
        model(torch.tensor([[4]]), PROMPT.shape[1])
    assert counted == [0, len(model.layers)]
    model.setup_caches()
    with torch.inference_mode():  # two rows never reach the hook
        model(PROMPT.expand(2, -1), 0)
        model(torch.tensor([[4], [5]]), PROMPT.shape[1])
    assert counted == [0, len(model.layers)]


def test_a_norm_weight_it_cannot_read_is_declined(built):
    block = built.model.layers[0]
    x = torch.ones(1, built.model.args.dim, dtype=torch.bfloat16)
    kw = block.one_token_impl.keywords
    attention = block.attention
    built.model.setup_caches()
    cache = attention.cache
    args = (x, 5, None, None, kw["layer"], (*cache.store.tensors(), cache.chunk or 0, False),
            (block.feed_forward.router_fp32(), *kw["weights"]))  # fmt: skip
    w, eps = block.attention_norm.weight, block.attention_norm.eps
    assert block_layer.one_token_block(*args, (w.float(), eps, w, eps)) is None  # fp32 weight
    assert block_layer.one_token_block(*args, (w[:-1], eps, w, eps)) is None  # too short
    assert block_layer.one_token_block(*args, (w, eps, w, eps)) is not None
