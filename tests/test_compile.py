"""Compiled decode (``Llama4.build(compile=True)``, ``Transformer.compile_decode``) on the tiny preset.

One graph per decode step (fullgraph=True: a graph break fails), the same greedy tokens as eager
for 64 tokens, logits within bf16 rounding of eager's, and recompiles bounded: one graph for
batch 1 and one for every larger batch, whatever the positions.
"""

import pytest
import torch

import quantization

# bf16 mode none and the fp32 int4 build that once decoded token 0 at every step when compiled
CASES = [("none", torch.bfloat16), ("int4_mixed", torch.float32)]


def build(ckpt, mode, dtype, compile):  # noqa: A002
    return quantization.build(ckpt, mode, max_seq_len=128, max_batch_size=4, dtype=dtype, compile=compile,
                              progress=False)  # fmt: skip


def test_eager_by_default_compiled_when_the_environment_says_so(tiny_ckpt, dist1, monkeypatch):
    from llama_lite.generation import Llama4

    monkeypatch.delenv("LLAMA_LITE_COMPILE")
    assert Llama4.build(tiny_ckpt, max_seq_len=16, max_batch_size=1).compile_seconds is None
    # compile=None with LLAMA_LITE_COMPILE=1 is on: the cases below build with it


@pytest.mark.parametrize("said,device,world,want", [
    (None, "cuda", 1, True), (None, "cpu", 1, False), (None, "cuda", 2, False),
    ("0", "cuda", 1, False), ("1", "cpu", 1, True), ("on", "cpu", 2, False), ("no", "cuda", 1, False),
])
def test_compile_default_is_on_for_one_cuda_device(monkeypatch, said, device, world, want):
    """CUDA graphs took an H200's decode step to 3-6x eager's speed; on CPUs compiling did not pay."""
    from llama_lite.generation import compile_by_default

    if said is None:
        monkeypatch.delenv("LLAMA_LITE_COMPILE", raising=False)
    else:
        monkeypatch.setenv("LLAMA_LITE_COMPILE", said)
    assert compile_by_default(torch.device(device), world) is want


def decode_logits(llama, prompt, steps):
    """Logits of ``steps`` greedy decode steps after ``prompt`` (rows of equal length), [steps, B, V]."""
    model = llama.model
    tokens = torch.tensor(prompt)
    logits = model(tokens, 0, last_index=torch.full((len(prompt),), len(prompt[0]) - 1))
    out, pos = [], len(prompt[0])
    for _ in range(steps):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        logits = model(nxt, torch.full((len(prompt),), pos))
        out.append(logits[:, -1])
        pos += 1
    return torch.stack(out)


def graphs_compiled() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("mode,dtype", CASES, ids=[f"{m}-{str(d)[6:]}" for m, d in CASES])
def test_compiled_decode_equals_eager(tiny_ckpt, dist1, mode, dtype, monkeypatch):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setenv("LLAMA_LITE_COMPILE", "1")
    eager, compiled = build(tiny_ckpt, mode, dtype, False), build(tiny_ckpt, mode, dtype, None)
    assert compiled.compile_seconds > 0 and graphs_compiled() == 1  # compiled at load, batch 1
    prompts = [[1 + 3 * i for i in range(9)], [7, 8, 9], [11, 12, 13, 14, 15]]

    want = eager.generate_tokens(prompts[:1], temperature=0, max_gen_len=64)
    got = compiled.generate_tokens(prompts[:1], temperature=0, max_gen_len=64)
    assert len(want[0]) == 64 and len(set(want[0])) > 8  # real text, not one repeated token
    assert got == want
    if dtype == torch.bfloat16:  # batches: one more graph (dynamic batch), for 3 and for 2 rows
        assert compiled.generate_tokens(prompts, temperature=0, max_gen_len=16) == eager.generate_tokens(
            prompts, temperature=0, max_gen_len=16)
        assert compiled.generate_tokens(prompts[1:], temperature=0, max_gen_len=8) == eager.generate_tokens(
            prompts[1:], temperature=0, max_gen_len=8)
    # every position so far (and batch sizes 3 and 2) in at most two graphs
    assert graphs_compiled() == (2 if dtype == torch.bfloat16 else 1), torch._dynamo.utils.counters["stats"]

    a = decode_logits(eager, [[5, 6, 7, 8]], 12)
    b = decode_logits(compiled, [[5, 6, 7, 8]], 12)
    if dtype == torch.float32:
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4 * float(a.abs().max()))
    else:  # within bf16 rounding: two bf16 steps of the largest logit
        assert float((b - a).abs().max()) <= 2 * 2.0**-7 * float(a.abs().max())


def test_eager_decode_runs_no_compiled_graph(tiny_ckpt, dist1):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    llama = build(tiny_ckpt, "none", torch.bfloat16, False)
    assert llama.model._decode_compiled is None
    llama.generate_tokens([[1, 2, 3]], temperature=0, max_gen_len=4)
    assert graphs_compiled() == 0


@pytest.mark.parametrize("mode", [None, "reduce-overhead", "max-autotune-no-cudagraphs"])
def test_compile_decode_takes_torch_compile_modes(tiny_ckpt, dist1, mode):
    """CUDA builds ask for mode "reduce-overhead" (CUDA graphs); torch.compile refuses a mode beside
    options, so the mode's options must join compile_decode's own (torch.compile is lazy: nothing
    compiles here)."""
    llama = build(tiny_ckpt, "none", torch.bfloat16, False)
    llama.model.compile_decode(mode)
    assert callable(llama.model._decode_compiled)
