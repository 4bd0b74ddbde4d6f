"""kernels.OneTokenAttention: an attention layer's decode step for one token in one library call,
against the same layer computed as the core computes it (``kernels.linear`` for each GEMV, RoPE
and the temperature in PyTorch, the heads' ``kernels.rmsnorm``, ``kernels.decode_step``), under
every CPU cap, on both cache layouts, across chunk boundaries.

The GEMVs, the norm and the attention are the same functions, and the glue has the core's
roundings, so logits and caches must be bit-equal: any difference is a bug.
"""

import pytest
import torch

import kernels
import quantization
from kernels import attention_layer, cpu
from llama_lite.model import Attention

from one_call import PROMPT, check_against_separate_calls

ISAS = cpu.cpu_isas()


@pytest.fixture(scope="module", params=[("none", None), ("int4_mixed", None), ("int4_mixed", "all"), ("nvfp4", "all")],
                ids=["bf16", "int4_mixed", "int4_all", "nvfp4_all"])  # fmt: skip
def built(request, tiny_ckpt, dist1):
    mode, targets = request.param
    llama = quantization.build(tiny_ckpt, mode, targets=targets, max_seq_len=64, max_batch_size=1, progress=False)
    llama.model.one_token_impl = None  # the attention layer's own call (test_block_layer.py: the blocks')
    for block in llama.model.layers:
        block.one_token_impl = None
    return llama


@pytest.fixture
def counted(monkeypatch):
    """[taken, declined]: the one-call layer's calls."""
    n = [0, 0]
    real = attention_layer.OneTokenAttention.__call__

    def call(self, *args):
        out = real(self, *args)
        n[out is None] += 1
        return out

    monkeypatch.setattr(attention_layer.OneTokenAttention, "__call__", call)
    return n


@pytest.mark.parametrize("layout", ["by_kind", "full"])
@pytest.mark.parametrize("isa", ISAS)
def test_matches_the_separate_calls(built, layout, isa, counted):
    model = built.model
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert layers and all(a.one_token_impl is not None for a in layers)
    assert any(a.temperature_tuning for a in layers) and any(a.use_rope and a.use_qk_norm for a in layers)
    check_against_separate_calls(model, layers, layout, isa, counted, cpu)


def test_declines_what_it_does_not_compute(tiny_ckpt, dist1, counted):
    # fp8 activations are quantized in PyTorch: not in this call
    fp8 = quantization.build(tiny_ckpt, "fp8_mixed", targets="all", max_seq_len=64, max_batch_size=1, progress=False)
    with torch.inference_mode():
        fp8.model(PROMPT, 0)
        fp8.model(torch.tensor([[4]]), PROMPT.shape[1])
    assert counted == [0, 4]
    # an fp8 KV cache, and two rows: the core's path
    bf16 = quantization.build(tiny_ckpt, "none", max_seq_len=64, max_batch_size=2, progress=False)
    model = bf16.model
    model.setup_caches(dtype=torch.float8_e4m3fn)
    with torch.inference_mode():
        model(PROMPT, 0)
        model(torch.tensor([[4]]), PROMPT.shape[1])
    assert counted == [0, 8]
    model.setup_caches()
    with torch.inference_mode():
        model(PROMPT.expand(2, -1), 0)
        model(torch.tensor([[4], [5]]), PROMPT.shape[1])
    assert counted == [0, 8]  # two rows never reach the hook


@pytest.mark.parametrize("isa", ISAS)
def test_a_position_outside_the_cache_is_refused(built, isa):
    attention = next(m for m in built.model.modules() if isinstance(m, Attention) and not m.use_rope)
    attention.setup_cache(1, 16, torch.bfloat16, "cpu")  # a global layer's cache of 16 positions
    x = torch.ones(1, built.model.args.dim, dtype=torch.bfloat16)
    k, v, ks, vs = attention.cache.store.tensors()
    layer = attention.one_token_impl.keywords["layer"]
    cpu.set_isa(isa)
    try:
        if isa == "none":
            assert layer(x, 16, None, None, k, v, ks, vs, 0, False) is None
            return
        assert layer(x, 15, None, None, k, v, ks, vs, 0, False) is not None
        with pytest.raises(ValueError, match="position 16 lies outside"):
            layer(x, 16, None, None, k, v, ks, vs, 0, False)
    finally:
        cpu.set_isa(None)
        built.model.setup_caches()


def test_direct_use_with_random_weights_and_a_ring():
    """The class on its own (no model): int4 weights, a ring cache of 8 slots over 20 positions,
    RoPE + qk norm, against the same steps written with the separate kernels."""
    from quantization.formats import quantize_int4

    g = torch.Generator().manual_seed(0)
    d, h, hkv, hd, chunk = 256, 4, 2, 64, 8

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    ws = [quantize_int4(rand(h * hd, d)), quantize_int4(rand(hkv * hd, d)), quantize_int4(rand(hkv * hd, d)),
          quantize_int4(rand(d, h * hd))]  # fmt: skip
    for w in ws:
        kernels.prepare(w)
    freqs = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    from llama_lite.model import apply_rope, rope_at

    for isa in ISAS:
        cpu.set_isa(isa)
        try:
            layer = kernels.OneTokenAttention(*ws, h, hkv, hd, 1e-5)
            caches = [torch.zeros(1, chunk, hkv, hd, dtype=torch.bfloat16) for _ in range(4)]
            empty = torch.empty(0)
            for pos in range(20):
                x = rand(1, d) * 20
                rope = rope_at(freqs, torch.tensor([[pos]]))
                got = layer(x, pos, tuple(r.reshape(-1) for r in rope), 1.25, caches[0], caches[1], empty, empty,
                            chunk, True)  # fmt: skip
                if isa == "none":
                    assert got is None
                    continue
                q = kernels.linear(x, ws[0]).view(1, 1, h, hd)
                k = kernels.linear(x, ws[1]).view(1, 1, hkv, hd)
                v = kernels.linear(x, ws[2]).view(1, 1, hkv, hd)
                qk = kernels.rmsnorm(apply_rope(torch.cat((q, k), dim=2), rope), None, 1e-5)
                q, k = qk.split((h, hkv), dim=2)
                q = (q * torch.full((1, 1, 1, 1), 1.25)).to(torch.bfloat16)  # fp32 times bf16: fp32, as the core
                attn = kernels.decode_step(q, k, v, caches[2], caches[3], empty, empty, torch.tensor([pos]), chunk, True)
                want = kernels.linear(attn.reshape(1, -1), ws[3])
                assert torch.equal(got, want), (isa, pos, float((got - want).abs().max()))
                assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        finally:
            cpu.set_isa(None)


def test_one_call_layers_under_tensor_parallelism(tiny_ckpt, tmp_path):
    """Two ranks, bf16, batch 1: each rank's one-call attention and MoE layers return its partial
    wo / W2 sums and the core reduces them, as with the separate calls: the same bits."""
    from helpers import ROOT, run_ranks

    out = tmp_path / "one_call_tp2.pt"
    proc = run_ranks(2, [str(ROOT / "tests" / "workers" / "one_call_worker.py"), str(tiny_ckpt), str(out),
                         "none,int4_mixed", "2"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for mode, r in torch.load(out, weights_only=True).items():
        assert r["expected"] > 0 and r["taken"] == (0 if cpu.isa() == "none" else r["expected"]), mode
        assert r["blocks"] == 0, mode  # a one-call block would skip the reduction between its layers
        assert torch.equal(r["one_call"], r["separate"]), (mode, float((r["one_call"] - r["separate"]).abs().max()))
