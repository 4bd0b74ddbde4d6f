"""Long context and multi-turn: KV cache bytes and decode speed by context length, before (the full
layout: max_seq_len on every layer) and after (by kind: one chunk on chunked layers; bf16 and fp8),
Scout's KV cache at 128k and 1M tokens, and the time to first token of later turns of a long
conversation with and without reusing its cache.

    python -m scripts.bench_context CKPT [--contexts 1024,8192,32768] [--conversation_len 4096]
    python -m scripts.bench_context CKPT --quick      # seconds, on any checkpoint (a smoke test)

The context is filled with random tokens in pieces of --fill_piece (so prefill attention stays
small), growing from one context length to the next, and at each --decode_tokens single-token
steps are timed (median of the per-step times). Timings on a shared machine are rough.
"""

import json
import statistics
import sys
import time
from typing import Optional

import torch

from llama_lite import Llama4
from llama_lite.args import ModelArgs
from llama_lite.kv_cache import FP8, kv_cache_bytes
from llama_lite.memory import format_bytes
from scripts.common import FlagError, path_flag, run_cli

# Llama 4 Scout's attention, as its params.json states it (the rest does not change the KV cache).
SCOUT = dict(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, head_dim=128, attention_chunk_size=8192,
             nope_layer_interval=4, vocab_size=202048)
VARIANTS = (("full", "bf16"), ("by_kind", "bf16"), ("by_kind", "fp8"))


def build(ckpt, **kwargs) -> Llama4:
    """As the scripts build a model: through the quantized loader with nothing to quantize, so on a
    CPU the bf16 layers run on the kernels' GEMV (plain torch.mv in bf16 is slow on some CPUs)."""
    import quantization

    return quantization.build(ckpt, "none", progress=False, **kwargs)


def scout_kv_bytes() -> list[dict]:
    args = ModelArgs(**SCOUT)
    rows = []
    for tokens in (128 * 1024, 1024 * 1024):
        for layout, kv in VARIANTS:
            dtype = FP8 if kv == "fp8" else torch.bfloat16
            rows.append(dict(context=tokens, layout=layout, kv_dtype=kv,
                             bytes=kv_cache_bytes(args, tokens, 1, dtype, layout)))
    return rows


def fill(model, begin: int, n: int, piece: int, gen: torch.Generator) -> None:
    """Write random tokens at positions [begin, n) of row 0 of the cache, piece by piece, computing
    only the last logits."""
    for start in range(begin, n, piece):
        m = min(piece, n - start)
        tokens = torch.randint(0, 200000, (1, m), generator=gen)
        model(tokens, start, last_index=torch.tensor([m - 1]))


def decode_speed(model, context: int, steps: int) -> float:
    """Median tokens/s of single-token steps at positions context, context + 1, ..."""
    times = []
    token = torch.tensor([[1000]])
    for t in range(steps):
        begin = time.perf_counter()
        model(token, context + t)
        times.append(time.perf_counter() - begin)
    return 1.0 / statistics.median(times)


def context_rows(ckpt, contexts: list[int], steps: int, piece: int, dtype, variants=VARIANTS) -> list[dict]:
    rows = []
    for layout, kv in variants if contexts else ():
        llama = build(ckpt, max_seq_len=max(contexts) + steps, max_batch_size=1, dtype=dtype,
                      kv_cache_dtype=kv, kv_cache_layout=layout)
        gen = torch.Generator().manual_seed(0)
        filled_to = 0
        for n in sorted(contexts):
            # Grow the context from the last one (the decode steps timed there are overwritten).
            begin = time.perf_counter()
            fill(llama.model, filled_to, n, piece, gen)
            filled_to = n
            filled = time.perf_counter() - begin
            rate = decode_speed(llama.model, n, steps)
            rows.append(dict(layout=layout, kv_dtype=kv, context=n, kv_bytes=llama.model.kv_cache_bytes(),
                             decode_tok_s=rate, fill_s=filled))
            print(f"[bench_context] {layout}/{kv} at {n}: {rate:.1f} tok/s (filled in {filled:.1f} s)",
                  file=sys.stderr, flush=True)
        del llama
    return rows


def first_token_seconds(steps) -> float:
    begin = time.perf_counter()
    for _ in steps:
        break
    return time.perf_counter() - begin


def conversation_rows(ckpt, length: int, turns: int, dtype) -> list[dict]:
    """Turn 1: a user message of about ``length`` tokens; then short turns. Each later turn's time to
    first token with the conversation's cache (only the new message prefilled) and without (a fresh
    prefill of the whole conversation, on a second model with the same weights)."""
    kw = dict(max_seq_len=length + 64 * turns + 256, max_batch_size=1, dtype=dtype)
    llama, fresh = build(ckpt, **kw), build(ckpt, **kw)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly box".split()
    chat = llama.conversation()
    sampling = dict(temperature=0, max_gen_len=8)
    list(chat.send(" ".join(words[i % len(words)] for i in range(length)), **sampling))
    rows = []
    for turn in range(2, turns + 1):
        message = f"and what about question number {turn}?"
        whole = chat.prompt_with(message)
        without = first_token_seconds(fresh.generate([whole], **sampling))
        steps = chat.send(message, **sampling)
        reused = first_token_seconds(steps)
        list(steps)
        rows.append(dict(turn=turn, conversation_tokens=len(whole), prefilled_with_reuse=chat.last_prefill,
                         ttft_reuse_s=reused, ttft_fresh_s=without))
        print(f"[bench_context] turn {turn}: {len(whole)} tokens, TTFT {reused:.3f} s with reuse "
              f"({chat.last_prefill} prefilled), {without:.3f} s without", file=sys.stderr, flush=True)
    return rows


def report(result: dict) -> str:
    out = ["| layout | KV dtype | context | KV cache | decode tok/s |", "|---|---|---|---|---|"]
    for r in result["contexts"]:
        out.append(f"| {r['layout']} | {r['kv_dtype']} | {r['context']} | {format_bytes(r['kv_bytes'])} "
                   f"| {r['decode_tok_s']:.1f} |")
    out += ["", "Scout (48 layers, 8 KV heads, head_dim 128, chunk 8192, NoPE every 4th layer), batch 1:",
            "| context | layout | KV dtype | KV cache |", "|---|---|---|---|"]
    for r in result["scout"]:
        out.append(f"| {r['context']} | {r['layout']} | {r['kv_dtype']} | {r['bytes'] / 1e9:.2f} GB |")
    out += ["", "| turn | conversation tokens | prefilled with reuse | TTFT with reuse | TTFT without |",
            "|---|---|---|---|---|"]
    for r in result["conversation"]:
        out.append(f"| {r['turn']} | {r['conversation_tokens']} | {r['prefilled_with_reuse']} "
                   f"| {r['ttft_reuse_s']:.3f} s | {r['ttft_fresh_s']:.3f} s |")
    return "\n".join(out)


def main(
    checkpoint_dir: str,
    contexts: str = "1024,8192,32768",
    decode_tokens: int = 16,
    fill_piece: int = 1024,
    conversation_len: int = 4096,
    turns: int = 5,
    dtype: str = "bf16",
    quick: bool = False,
    out: Optional[str] = None,
    variants: str = "full:bf16,by_kind:bf16,by_kind:fp8",
) -> None:
    """Measure KV cache size and decode speed by context, and conversation reuse.

    Args:
        checkpoint_dir: The checkpoint to measure (e.g. one written by scripts.random_checkpoint).
        contexts: Comma-separated context lengths at which decode speed is measured.
        decode_tokens: Single-token decode steps timed at each context.
        fill_piece: Tokens per prefill call while filling the context.
        conversation_len: Tokens of the first user message of the conversation.
        turns: Turns of the conversation (the TTFT of turns 2..turns is measured).
        dtype: bf16 or fp32 weights and activations.
        quick: Tiny sizes (contexts 64,200; a 100-token conversation of 3 turns), for a smoke test.
        out: Also write the figures as JSON to this file.
        variants: Comma-separated layout:kv_dtype pairs to measure (layouts full, by_kind; bf16, fp8).
    """
    ckpt = path_flag("checkpoint_dir", checkpoint_dir)
    if dtype not in ("bf16", "fp32"):
        raise FlagError(f"unknown --dtype {dtype!r}; choose bf16 or fp32")
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    if quick:
        contexts, decode_tokens, fill_piece, conversation_len, turns = "64,200", 3, 64, 100, 3
    try:
        lengths = [int(c) for c in str(contexts).replace("(", "").replace(")", "").split(",") if str(c).strip()]
        pairs = [tuple(v.split(":")) for v in str(variants).split(",") if v.strip()]
        assert all(len(p) == 2 and p[0] in ("full", "by_kind") and p[1] in ("bf16", "fp8") for p in pairs)
    except (ValueError, AssertionError):
        raise FlagError(f"--contexts must be comma-separated integers and --variants layout:dtype pairs, got "
                        f"{contexts!r} and {variants!r}") from None
    from llama_lite.distributed import init_distributed

    init_distributed(1, "cpu")
    result = dict(checkpoint=str(ckpt), scout=scout_kv_bytes(),
                  contexts=context_rows(ckpt, lengths, decode_tokens, fill_piece, torch_dtype, pairs),
                  conversation=conversation_rows(ckpt, conversation_len, turns, torch_dtype) if turns > 1 else [])
    print(report(result))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    run_cli(main)
