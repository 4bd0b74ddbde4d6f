"""kernels.attention: a decode step's attention over a KV cache, against the fp32 reference.

Under each CPU cap with a C library the kernel's fp32 result is within 1e-5 of the reference's
largest output (scores, softmax and the weighted sum in fp32 on both sides; they differ by fp32
summation order and e^x's few ulp: observed ~1e-6 at 1000 slots), and its bf16 result is that
fp32 result rounded once. Under the cap ``none`` it is PyTorch's SDPA, which rounds the softmax
weights to bf16 on the way (so only a bf16-level bound holds there).
"""

import logging

import pytest
import torch

from kernels import attention, cpu
from kernels import reference as R

ISAS = cpu.cpu_isas()

# (B, H, Hkv, D, slots in the cache, slots attended): G = 4, 4, 5 (more than one pass of four
# queries), 1; D 128 / 64 / 16 / 8; n below, at and above the 64-slot value blocks, and 1
SHAPES = [(1, 16, 4, 128, 64, 40), (3, 8, 2, 64, 100, 77), (2, 10, 2, 16, 9, 9), (1, 40, 8, 128, 300, 300),
          (2, 4, 4, 8, 5, 1), (1, 16, 4, 128, 200, 130)]  # fmt: skip


@pytest.fixture(params=ISAS)
def isa(request):
    cpu.set_isa(request.param)
    yield request.param
    cpu.set_isa(None)


def cache_views(b, hkv, d, slots, n, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, slots, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(b, slots, hkv, d, generator=g).to(torch.bfloat16)
    return k[:, :n], v[:, :n]  # views with the cache's strides, as the core passes them


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_the_reference(shape, isa):
    b, h, hkv, d, slots, n = shape
    keys, values = cache_views(b, hkv, d, slots, n, seed=n)
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(b, 1, h, d, generator=g) * 2).to(torch.bfloat16)
    mask = torch.rand(b, 1, 1, n, generator=g) < 0.7
    mask[..., n - 1] = True
    if b > 1:
        mask[1] = False  # a row with nothing to attend to gives zeros
    ref = R.decode_attention(q.float(), keys, values, mask)
    scale = ref.abs().max()
    if isa == "none":
        assert attention.path(q, keys, values) == "sdpa"
        out = attention.decode_attention(q, keys, values, mask)
        live = mask.reshape(b, n).any(-1)
        assert (out[live].float() - ref[live]).abs().max() <= 2**-6 * scale
        return
    assert attention.path(q, keys, values) == f"cpu/{cpu.isa()}"  # amx may resolve to avx512
    out32 = attention.decode_attention(q, keys, values, mask, out_dtype=torch.float32)
    err = (out32 - ref).abs().max()
    assert err <= 1e-5 * scale, (err / scale).item()
    if b > 1:
        assert torch.equal(out32[1], torch.zeros_like(out32[1]))
    out = attention.decode_attention(q, keys, values, mask)
    assert out.dtype == torch.bfloat16 and torch.equal(out, out32.to(torch.bfloat16))


def test_large_scores_do_not_overflow(isa):
    """Scores far from 0 (e^x clamped, masked slots exactly 0): softmax stays exact."""
    keys, values = cache_views(1, 2, 16, 70, 70, seed=3)
    q = torch.full((1, 1, 4, 16), 30.0).to(torch.bfloat16)  # scores up to ~ +-500
    mask = torch.ones(1, 1, 1, 70, dtype=torch.bool)
    mask[..., ::3] = False
    ref = R.decode_attention(q.float(), keys, values, mask)
    out32 = attention.decode_attention(q, keys, values, mask, out_dtype=torch.float32)
    assert torch.isfinite(out32).all()
    bound = 2**-6 if isa == "none" else 1e-5  # SDPA rounds its softmax weights to bf16
    assert (out32 - ref).abs().max() <= bound * ref.abs().max()


def test_paths_and_their_log(caplog):
    keys, values = cache_views(1, 2, 16, 8, 8, seed=0)
    q = torch.randn(1, 1, 4, 16).to(torch.bfloat16)
    lib = [i for i in ISAS if i != "none"]
    try:
        with caplog.at_level(logging.INFO, logger="llama_lite.kernels"):
            attention._logged.clear()
            if lib:
                cpu.set_isa(lib[-1])
                assert attention.path(q, keys, values) == f"cpu/{lib[-1]}"
                assert attention.path(q.float(), keys.float(), values.float()) == "sdpa"  # bf16 only
                assert attention.path(q[..., :12], keys[..., :12], values[..., :12]) == "sdpa"  # D % 8
                attention.decode_attention(q, keys, values, torch.ones(1, 1, 1, 8, dtype=torch.bool))
                assert f"decode attention -> cpu/{lib[-1]}" in caplog.text
            cpu.set_isa("none")
            assert attention.path(q, keys, values) == "sdpa"
            attention.decode_attention(q, keys, values, torch.ones(1, 1, 1, 8, dtype=torch.bool))
            assert "decode attention -> sdpa" in caplog.text
    finally:
        cpu.set_isa(None)


# (B, Hq, Hkv, D, cache slots, chunk, ring, positions per row): a ring (slot p % chunk), a prefix
# cache (slot p), a prefix cache masked to its chunk (the full layout's chunked layers)
STEPS = [(1, 16, 4, 128, 64, 32, True, [45]), (3, 8, 2, 64, 100, 0, False, [0, 57, 99]),
         (2, 10, 2, 16, 40, 16, False, [17, 33]), (2, 4, 4, 8, 8, 8, True, [7, 8])]  # fmt: skip


@pytest.mark.parametrize("case", STEPS, ids=lambda c: f"b{c[0]}-chunk{c[5]}-{'ring' if c[6] else 'prefix'}")
def test_decode_step_is_the_cores_step_in_one_call(case, isa):
    """``decode_step`` writes the cache as the core's step does and gives the same bits as the
    core's step attending with ``decode_attention`` (the same kernel, its mask made in C)."""
    from llama_lite import kv_cache

    b, h, hkv, d, slots, chunk, ring, pos = case
    g = torch.Generator().manual_seed(slots)
    cache = [torch.randn(b, slots, hkv, d, generator=g).to(torch.bfloat16) for _ in range(2)]
    q = torch.randn(b, 1, h, d, generator=g).to(torch.bfloat16)
    qk = torch.randn(b, 1, h + hkv, d, generator=g).to(torch.bfloat16)
    k = qk[:, :, h:]  # a view with a row stride of (h + hkv) * d, as the core's split leaves it
    v = torch.randn(b, 1, hkv, d, generator=g).to(torch.bfloat16)
    positions = torch.tensor(pos)
    empty = torch.zeros(0)
    mine = [c.clone() for c in cache]
    out = attention.decode_step(q, k, v, *mine, empty, empty, positions, chunk, ring)
    if isa == "none":
        assert out is None and all(torch.equal(a, c) for a, c in zip(mine, cache))  # nothing written
        return
    core = [c.clone() for c in cache]
    impl = kv_cache.register_attention(attention.decode_attention)
    ref = kv_cache.decode_attention_eager(q, k, v, *core, empty, empty, positions, chunk, ring, impl)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    assert torch.equal(mine[0], core[0]) and torch.equal(mine[1], core[1])
    slot = [p % chunk for p in pos] if ring else pos
    assert all(torch.equal(mine[0][i, slot[i]], k[i, 0]) for i in range(b))  # the new key is there


def test_decode_step_leaves_other_caches_to_the_core():
    """fp8 caches, fp32 activations and positions beyond the cache are not the kernel's."""
    q = torch.randn(1, 1, 4, 16).to(torch.bfloat16)
    k = v = torch.randn(1, 1, 2, 16).to(torch.bfloat16)
    bf16 = torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16)
    fp8 = torch.zeros(1, 8, 2, 16, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(1, 8, 2)
    empty = torch.zeros(0)
    pos = torch.tensor([3])
    assert attention.decode_step(q, k, v, fp8, fp8.clone(), scales, scales.clone(), pos, 0, False) is None
    assert attention.decode_step(q.float(), k.float(), v.float(), bf16.float(), bf16.float(), empty, empty, pos, 0,
                                 False) is None  # fmt: skip
    if cpu.isa() != "none":
        with pytest.raises(RuntimeError, match="rejected positions"):
            attention.decode_step(q, k, v, bf16, bf16.clone(), empty, empty, torch.tensor([8]), 0, False)
        assert torch.equal(bf16, torch.zeros_like(bf16))  # a rejected step writes nothing


# ---- many queries per row (a prefill)

# (B, S, H, Hkv, D, cached slots before the new ones, mask): G = 4, 4, 1, 5; S within one block of
# 16 positions, across several, and 1; D 128 / 64 / 32 / 16; "causal" (new keys after the cached
# ones), "holes" (causal with a random 30% masked, first allowed keys off the 16-key blocks, and a
# row with nothing to attend to), "chunk" (a chunked layer's window: each query sees its chunk only)
PREFILL = [(1, 40, 16, 4, 128, 0, "causal"), (2, 37, 8, 2, 64, 13, "holes"), (3, 20, 4, 4, 32, 0, "holes"),
           (1, 1, 10, 2, 16, 70, "causal"), (1, 70, 5, 1, 64, 30, "chunk")]  # fmt: skip


def prefill_case(b, s, h, hkv, d, cached, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = cached + s
    keys, values = cache_views(b, hkv, d, n + 5, n, seed=seed)
    # q as the core passes it: a view of q and k's heads joined
    qk = (torch.randn(b, s, h + hkv, d, generator=g) * 2).to(torch.bfloat16)
    q = qk[:, :, :h]
    pos = torch.arange(cached, n)
    mask = (torch.arange(n)[None] <= pos[:, None]).expand(b, 1, s, n).clone()
    if kind == "holes":
        mask &= torch.rand(b, 1, s, n, generator=g) < 0.7
        mask[..., :, :3] = False
        if b > 1:
            mask[1, 0, 2] = False
    elif kind == "chunk":
        mask &= (torch.arange(n)[None] // 32 == pos[:, None] // 32)
    return q, keys, values, mask


@pytest.mark.parametrize("case", PREFILL, ids=lambda c: "x".join(map(str, c)))
def test_prefill_matches_the_reference(case, isa):
    """Under the avx512 cap: the kernel's fp32 result within 1e-5 of the fp32 reference's largest
    output (the same bound as decode's), its bf16 result that rounded once, zeros for a query with
    nothing to attend to. Under other caps it does not apply (the core runs SDPA)."""
    q, keys, values, mask = prefill_case(*case)
    out32 = attention.prefill_attention(q, keys, values, mask, out_dtype=torch.float32)
    if isa != "avx512":
        assert out32 is None and attention.prefill_attention(q, keys, values, mask) is None
        return
    ref = R.decode_attention(q.float(), keys, values, mask)
    scale = ref.abs().max()
    err = (out32 - ref).abs().max()
    assert err <= 1e-5 * scale, (err / scale).item()
    live = mask.any(-1).squeeze(1)  # [B, S]
    assert torch.equal(out32[~live], torch.zeros_like(out32[~live]))
    out = attention.prefill_attention(q, keys, values, mask)
    assert out.dtype == torch.bfloat16 and torch.equal(out, out32.to(torch.bfloat16))
    # and SDPA (what the core runs without it) agrees within its bf16 softmax weights
    sdpa = attention._sdpa(q, keys, values, mask)
    assert (sdpa[live].float() - ref[live]).abs().max() <= 2**-6 * scale


def test_prefill_large_scores_and_what_it_leaves_to_sdpa(caplog):
    if "avx512" not in ISAS:
        pytest.skip("this CPU cannot run the avx512 path")
    cpu.set_isa("avx512")
    try:
        q, keys, values, mask = prefill_case(1, 20, 4, 2, 32, 5, "holes", seed=4)
        q = torch.full_like(q, 30.0)  # scores up to ~ +-500: e^x clamped, masked keys exactly 0
        with caplog.at_level(logging.INFO, logger="llama_lite.kernels"):
            attention._logged.clear()
            out32 = attention.prefill_attention(q, keys, values, mask, out_dtype=torch.float32)
            assert "prefill attention -> cpu/avx512" in caplog.text
        ref = R.decode_attention(q.float(), keys, values, mask)
        assert torch.isfinite(out32).all() and (out32 - ref).abs().max() <= 1e-5 * ref.abs().max()
        assert attention.prefill_attention(q.float(), keys.float(), values.float(), mask) is None  # bf16 only
        assert attention.prefill_attention(q[..., :24], keys[..., :24], values[..., :24], mask) is None  # D % 16
        assert attention.prefill_attention(q, keys, values, mask.float()) is None  # a bool mask only
    finally:
        cpu.set_isa(None)
