"""What the one-call decode tests share (test_attention_layer.py, test_block_layer.py): a prompt and
twelve decode steps across the tiny preset's KV-cache chunks, and the check that a model decodes to
the same bits with its one-call modules and with the separate calls they replace."""

import torch

from llama_lite.model import Attention

PROMPT = torch.tensor([[1, 500, 1000, 1500, 2000]])
NEXT = [42, 7, 99, 1234, 5, 600, 3, 8, 9, 10, 11, 12]  # positions 5..16: across the tiny preset's chunks of 8


def decode(model, layout: str):
    """Logits of the NEXT steps after PROMPT, and every attention layer's K and V cache."""
    model.setup_caches(layout=layout)
    with torch.inference_mode():
        model(PROMPT, 0)
        logits = torch.cat([model(torch.tensor([[t]]), PROMPT.shape[1] + i)[:, -1] for i, t in enumerate(NEXT)])
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    return logits, [(a.cache.store.k.clone(), a.cache.store.v.clone()) for a in layers]


def check_against_separate_calls(model, owners: list, layout: str, isa: str, counted: list, cpu) -> None:
    """Decode under the cap ``isa`` with each of ``owners``' ``one_token_impl`` (every decode step of
    every owner takes it, none of the prefill; none on ``none``), then with them removed: logits and
    caches bit-equal. ``counted``: [taken, declined] of the one-call function."""
    cpu.set_isa(isa)
    try:
        got, got_caches = decode(model, layout)
        taken, declined = counted
        if isa == "none":  # PyTorch only: the core's own path every time
            assert taken == 0 and declined == len(NEXT) * len(owners)
        else:
            assert taken == len(NEXT) * len(owners) and declined == 0
        impls = [o.one_token_impl for o in owners]
        for o in owners:
            o.one_token_impl = None
        try:
            want, want_caches = decode(model, layout)
        finally:
            for o, impl in zip(owners, impls):
                o.one_token_impl = impl
    finally:
        cpu.set_isa(None)
    assert torch.equal(got, want), float((got - want).abs().max())
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)
