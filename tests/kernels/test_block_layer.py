"""kernels.one_token_block: a decoder block's decode step for one token in one library call, against
the same block computed by the separate calls it replaces (the norms' ``kernels.rmsnorm``, the
one-call attention and MoE layers, the core's bf16 residual adds), under every CPU cap, on both
cache layouts, across chunk boundaries. kernels.plan_blocks / run_blocks (the model's
``one_token_impl``): every block of a step in one call, against the blocks' own calls.

The library runs the very functions of the separate calls and adds as PyTorch does (fp32 sum, one
rounding to bf16), so logits and caches must be bit-equal: any difference is a bug.
"""

import ctypes
import gc
import weakref

import pytest
import torch

import kernels
import quantization
from kernels import block_layer, cpu
from kernels import moe as moe_module

import one_call
from llama_lite.model import rope_at
from one_call import PROMPT, check_against_separate_calls

ISAS = cpu.cpu_isas()


@pytest.fixture(scope="module", params=[("none", None), ("int4_mixed", None), ("int4_mixed", "all")],
                ids=["bf16", "int4_mixed", "int4_all"])  # fmt: skip
def built(request, tiny_ckpt, dist1):
    mode, targets = request.param
    return quantization.build(tiny_ckpt, mode, targets=targets, max_seq_len=64, max_batch_size=1, progress=False)


def _count(monkeypatch, name: str) -> list:
    """[taken, declined]: calls of ``kernels.<name>`` that returned a result / None."""
    n = [0, 0]
    real = getattr(kernels, name)

    def call(*args):
        out = real(*args)
        n[out is None] += 1
        return out

    monkeypatch.setattr(kernels, name, call)
    return n


@pytest.fixture
def counted(monkeypatch):
    """[taken, declined]: the one-call block's calls."""
    return _count(monkeypatch, "one_token_block")


@pytest.fixture
def counted_steps(monkeypatch):
    """[taken, declined]: the model's all-blocks call (taken: run_blocks ran; declined: it returned None)."""
    return _count(monkeypatch, "run_blocks")


@pytest.mark.parametrize("layout", ["by_kind", "full"])
@pytest.mark.parametrize("isa", ISAS)
def test_matches_the_separate_calls(built, layout, isa, counted, monkeypatch):
    model = built.model
    monkeypatch.setattr(model, "one_token_impl", None)  # each block's own call (below: all of them in one)
    blocks = list(model.layers)
    assert blocks and all(b.one_token_impl is not None for b in blocks)
    assert any(b.attention.temperature_tuning for b in blocks) and any(b.attention.use_rope for b in blocks)
    check_against_separate_calls(model, blocks, layout, isa, counted, cpu)


@pytest.mark.parametrize("layout", ["by_kind", "full"])
@pytest.mark.parametrize("isa", ISAS)
def test_all_blocks_in_one_call_match_the_blocks_calls(built, layout, isa, counted_steps):
    # the reference: each block's own call, itself bit-equal to the separate calls (above); every
    # decode and every new set of caches (each decode sets them up again) needs the plan made anew
    model = built.model
    assert model.one_token_impl is not None
    if isa == "none":  # no plan: the hook declines before run_blocks, each block then declines too
        cpu.set_isa(isa)
        try:
            logits, _ = one_call.decode(model, layout)
        finally:
            cpu.set_isa(None)
        assert counted_steps == [0, 0] and model.one_token_impl.kept[2] is None and logits.isfinite().all()
        return
    check_against_separate_calls(model, [model], layout, isa, counted_steps, cpu)


def test_a_new_plan_when_threads_or_router_change(built):
    # the same token at the same position (so the caches are left as they are) after each change;
    # a plan made before a change would still compute with what was there before it
    model = built.model
    hook = model.one_token_impl
    model.setup_caches()
    x = torch.ones(1, model.args.dim, dtype=torch.bfloat16)
    pos = torch.tensor([[3]])
    rope = rope_at(model.rope_freqs, pos)

    def step():
        with torch.inference_mode():
            out = hook(x, pos, rope)
        assert out is not None
        return out, hook.kept[2]

    first, plan = step()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one, plan1 = step()
    finally:
        torch.set_num_threads(threads)
    assert plan1 is not plan and plan1.blocks[0].nthreads == 1 and plan.blocks[0].nthreads == threads
    assert torch.equal(one, first)
    router = model.layers[0].feed_forward.router_DE
    saved = router.detach().clone()
    try:
        with torch.no_grad():
            router.mul_(-1)  # written in place: the router's fp32 copy is made again, so is the plan
        flipped, plan2 = step()
    finally:
        with torch.no_grad():
            router.copy_(saved)
    assert plan2 is not plan1 and not torch.equal(flipped, first)
    again, plan3 = step()
    assert plan3 is not plan2 and torch.equal(again, first)


def test_the_plan_holds_what_it_points_to(built):
    # the layers' plan dicts are emptied when they fill up; the all-blocks plan, made earlier and
    # still valid, must keep each block's plans and their GEMV argument blocks alive
    model = built.model
    hook = model.one_token_impl
    one_call.decode(model, "by_kind")
    plan = hook.kept[2]
    # the attention and MoE plans the C block plans point to (from the layers' dicts), and their
    # GEMVs' argument blocks
    blocks = [block_layer.LlkBlockPlan.from_address(plan.plans[i]) for i in range(len(model.layers))]
    used = {b.attn for b in blocks} | {b.moe for b in blocks}
    held = []
    for *_, layer, weights in hook.blocks:
        w1 = weights[0]
        moe_plans = moe_module._bf16_plans(w1) if isinstance(w1, torch.Tensor) else w1.prepared["moe_one_token"]
        dicts = (layer._plans, moe_plans)
        for entry in (e for d in dicts for e in d.values() if e[0] is not None and ctypes.addressof(e[0]) in used):
            held += [entry[0], *(a for a in entry[1] if isinstance(a, ctypes.Structure))]
        for d in (*dicts, layer.block_plans):
            d.clear()
    assert len([h for h in held if ctypes.addressof(h) in used]) == len(used)
    args = [weakref.ref(a) for a in held]
    del held, entry, blocks
    gc.collect()
    assert all(r() is not None for r in args)
    with torch.inference_mode():  # one more step with the same plan, against the blocks' own calls
        x = torch.ones(1, model.args.dim, dtype=torch.bfloat16)
        pos = torch.tensor([[len(one_call.NEXT) + one_call.PROMPT.shape[1]]])
        rope = rope_at(model.rope_freqs, pos)
        out = hook(x, pos, rope)
        assert hook.kept[2] is plan
        h = x.view(1, 1, -1)  # the blocks' calls write the same K and V at the same position again
        for b in model.layers:
            h = b(h, pos, rope, None)
    assert torch.equal(out, h.view(1, -1))


def test_new_caches_get_a_new_plan(built, monkeypatch):
    # every decode sets up new caches: the plan made from the last ones must not write into them
    model = built.model
    hook = model.one_token_impl
    got, _ = one_call.decode(model, "by_kind")
    plan = hook.kept[2]
    got2, _ = one_call.decode(model, "by_kind")
    assert hook.kept[2] is not plan
    monkeypatch.setattr(model, "one_token_impl", None)
    want, _ = one_call.decode(model, "by_kind")
    assert torch.equal(got, want) and torch.equal(got2, want)


def test_the_plan_keeps_no_replaced_cache_alive(built):
    model = built.model
    one_call.decode(model, "by_kind")  # the plan is made from these caches
    assert model.one_token_impl.kept[2] is not None
    old = weakref.ref(model.layers[0].attention.cache.store.k)
    model.setup_caches()
    gc.collect()
    assert old() is None


def test_a_position_outside_a_cache_names_the_block(built):
    model = built.model
    model.setup_caches()
    hook = model.one_token_impl
    first = next(i for i, b in enumerate(model.layers) if not b.attention.use_rope)  # a global layer
    model.layers[first].attention.setup_cache(1, 16, torch.bfloat16, "cpu")
    x = torch.ones(1, model.args.dim, dtype=torch.bfloat16)
    try:
        with torch.inference_mode():
            pos = torch.tensor([[15]])
            assert hook(x, pos, rope_at(model.rope_freqs, pos)) is not None
            pos = torch.tensor([[16]])
            with pytest.raises(ValueError, match=f"block {first}: position 16 lies outside"):
                hook(x, pos, rope_at(model.rope_freqs, pos))
    finally:
        model.setup_caches()


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


def test_the_temperature_is_the_cores_at_every_position(built):
    """The hook's temperature (one value per floor_scale positions where that is exact) equals the
    core's at positions on either side of each boundary and near 2^24, where fp32 stops being
    exact, computed afresh and from the memo; with a floor_scale that is not a power of two too."""
    model = built.model
    hook = model.one_token_impl
    attention = next(b.attention for b in model.layers if b.attention.temperature_tuning)
    kept, s = attention.floor_scale, int(attention.floor_scale)
    assert s & (s - 1) == 0  # Llama 4's 8192: the memo's case
    positions = [0, 1, s - 2, s - 1, s, 2 * s - 1, 2 * s, 5 * s + 3,
                 2**24 - 2, 2**24 - 1, 2**24, 2**24 + 7, 2**25 - 2, 2**30 + 1]  # fmt: skip
    try:
        for scale in (kept, 1000.0, 0.5):
            attention.floor_scale = scale
            hook.temperatures.clear()
            for p in positions + positions[::-1]:  # afresh, then from the memo
                t = torch.tensor([[p]])
                assert hook._temperature(attention, p, t) == float(attention.temperature(t)), (scale, p)
            # the memo holds one value per quotient, for the exact positions only (up to 2^24 - 1)
            want = {(p + 1) // s for p in positions if p + 1 <= 2**24} if scale == kept else set()
            assert {key[-1] for key in hook.temperatures} == want
    finally:
        attention.floor_scale = kept
        hook.temperatures.clear()
