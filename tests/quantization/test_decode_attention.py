"""The quantized loader points every attention layer's decode step at ``kernels.decode_attention``
on a CPU, and a model decodes with it as with the core's SDPA (the kernel keeps the softmax weights
in fp32 where SDPA rounds them to bf16, so logits agree to bf16 rounding, not bit for bit)."""

import torch

import kernels
import quantization
from kernels import attention
from llama_lite.kv_cache import register_attention
from llama_lite.model import Attention


PROMPT = [1, 500, 1000, 1500, 2000, 2500, 3000]
NEXT = [42, 7, 99, 1234, 5, 600]  # fed one per decode step (the same tokens for both runs)


def _decode_logits(llama):
    model = llama.model
    model.forward(torch.tensor([PROMPT]), start_pos=0)
    out = [model.forward(torch.tensor([[tok]]), start_pos=len(PROMPT) + i)[:, -1] for i, tok in enumerate(NEXT)]
    return torch.cat(out)


def test_loader_installs_the_kernel_and_decode_agrees_with_sdpa(tiny_ckpt, dist1, monkeypatch):
    llama = quantization.build(tiny_ckpt, "int4_mixed", max_seq_len=64, max_batch_size=1, progress=False)
    layers = [m for m in llama.model.modules() if isinstance(m, Attention)]
    impl = register_attention(kernels.decode_attention, kernels.decode_step)
    assert impl != 0 and layers and all(m.attend_impl == impl for m in layers)
    for m in [*layers, *llama.model.layers, llama.model]:  # the separate calls (the one-call ones: tests/kernels)
        m.one_token_impl = None

    calls, steps = [], []
    real, real_step = attention.decode_attention, attention.decode_step
    monkeypatch.setattr(attention, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(attention, "decode_step", lambda *a: steps.append(1) or real_step(*a))
    for m in layers:
        m.attend_impl = register_attention(attention.decode_attention, attention.decode_step)
    with_step = _decode_logits(llama)
    assert len(steps) == len(NEXT) * len(layers)  # every decode step of every layer, none in prefill
    assert len(calls) == (len(steps) if kernels.cpu.isa() == "none" else 0)  # the step did it all

    for m in layers:
        m.attend_impl = register_attention(attention.decode_attention)  # the core writes, the kernel attends
    llama.model.setup_caches()
    with_kernel = _decode_logits(llama)
    assert len(calls) == len(NEXT) * len(layers) * (2 if kernels.cpu.isa() == "none" else 1)
    assert torch.equal(with_step, with_kernel)  # the same kernel, the same mask: the same bits
    calls.clear()

    for m in layers:
        m.attend_impl = 0  # the core's SDPA
    llama.model.setup_caches()
    with_sdpa = _decode_logits(llama)
    assert not calls  # the core's own path
    err = (with_kernel - with_sdpa).abs().max() / with_sdpa.abs().max()
    assert err <= 2e-2, err.item()  # bf16 activations either way; the two differ in p's rounding


def test_the_plain_loader_keeps_sdpa(tiny_ckpt, dist1):
    from llama_lite import Llama4

    llama = Llama4.build(tiny_ckpt, max_seq_len=32, max_batch_size=1)
    assert all(m.attend_impl == 0 for m in llama.model.modules() if isinstance(m, Attention))
