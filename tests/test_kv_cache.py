"""KV caches by layer kind (a ring of one chunk on chunked layers, the filled prefix on global ones)
against the full max_seq_len cache on every layer and against transformers; fp8 storage; what the
cache costs in memory; conversations that continue from the cache."""

import json

import pytest
import torch

from helpers import make_checkpoint, run_ranks, same_routing
from llama_lite.args import args_from_params
from llama_lite.generation import Llama4
from llama_lite.kv_cache import FP8, PrefixCache, RingCache, Step, kv_cache_bytes

CHUNK = 8  # the tiny preset's attention_chunk_size


def build(path, **kw):
    return Llama4.build(path, max_seq_len=kw.pop("max_seq_len", 128), max_batch_size=kw.pop("max_batch_size", 4), **kw)


@pytest.fixture(scope="module")
def pair(tiny_ckpt, dist1):
    """The tiny weights, by-kind and full layouts, fp32 and bf16."""
    return {(dtype, layout): build(tiny_ckpt, dtype=dtype, kv_cache_layout=layout)
            for dtype in (torch.float32, torch.bfloat16) for layout in ("by_kind", "full")}


def run_script_of_calls(model, calls):
    """Logits of each forward call (tokens, start_pos, lengths) in turn, concatenated along S."""
    return [model(t, s, lengths=n) for t, s, n in calls]


def three_chunks_then_two_decoded():
    seq = torch.randint(0, 200000, (1, 5 * CHUNK), generator=torch.Generator().manual_seed(11))
    calls = [(seq[:, : 3 * CHUNK], 0, None)]
    calls += [(seq[:, t : t + 1], t, None) for t in range(3 * CHUNK, 5 * CHUNK)]
    return calls


def prefill_from_mid_chunk():
    """13 tokens, then 14 starting at position 13 (mid-chunk, spanning two boundaries), then decode."""
    seq = torch.randint(0, 200000, (1, 34), generator=torch.Generator().manual_seed(12))
    calls = [(seq[:, :13], 0, None), (seq[:, 13:27], 13, None)]
    calls += [(seq[:, t : t + 1], t, None) for t in range(27, 34)]
    return calls


def rows_at_different_positions():
    """Three rows of 5, 19 and 12 real tokens (padded), then each continues with a 6-token prefill
    from its own position (mid-chunk for two of them), then 9 decode steps."""
    g = torch.Generator().manual_seed(13)
    lens = torch.tensor([5, 19, 12])
    first = torch.randint(0, 200000, (3, 19), generator=g)
    calls = [(first, 0, lens)]
    calls.append((torch.randint(0, 200000, (3, 6), generator=g), lens.clone(), None))
    pos = lens + 6
    for _ in range(9):
        calls.append((torch.randint(0, 200000, (3, 1), generator=g), pos.clone(), None))
        pos = pos + 1
    return calls


CASES = {"3_chunks_decode_2": three_chunks_then_two_decoded, "mid_chunk_prefill": prefill_from_mid_chunk,
         "rows_at_different_positions": rows_at_different_positions}


def real_logits(outs, calls):
    """Only the logits of real tokens (padding's are meaningless), flattened to [tokens, V]."""
    picked = []
    for out, (_, _, lengths) in zip(outs, calls):
        for b in range(out.shape[0]):
            n = out.shape[1] if lengths is None else int(lengths[b])
            picked.append(out[b, :n])
    return torch.cat(picked)


@pytest.mark.parametrize("case", list(CASES))
def test_by_kind_equals_full_cache_fp32(pair, case):
    calls = CASES[case]()
    got = real_logits(run_script_of_calls(pair[torch.float32, "by_kind"].model, calls), calls)
    want = real_logits(run_script_of_calls(pair[torch.float32, "full"].model, calls), calls)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("case", list(CASES))
def test_by_kind_equals_full_cache_bf16(pair, case):
    """Within bf16 rounding, and the same greedy choice wherever the top two logits are further
    apart than that. Measured: identical logits for one row; 0.096 for the batch, whose prefill
    from different positions attends over a different number of keys than the full cache's
    (bf16 sums round differently), like test_generation's decode-vs-prefill bound (0.125). The
    by-kind model routes as the full one did (a near-tie may flip within that rounding)."""
    calls = CASES[case]()
    by_kind, full = pair[torch.bfloat16, "by_kind"].model, pair[torch.bfloat16, "full"].model
    want_outs, got_outs, margins = [], [], []
    with same_routing(by_kind, full) as flips:
        for t, s, n in calls:
            want_outs.append(full(t, s, lengths=n))
            got_outs.append(by_kind(t, s, lengths=n))
            seq = t.shape[1]
            margins += [m for row, m in flips if n is None or row % seq < int(n[row // seq])]
            flips.clear()
    got, want = real_logits(got_outs, calls), real_logits(want_outs, calls)
    tol = 0.125
    assert (got - want).abs().max() <= tol
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
    assert clear.float().mean() > 0.5 and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    assert all(margin <= 0.02 for margin in margins), margins


def test_decode_reads_at_most_a_chunk_and_only_the_filled_prefix():
    """Direct look at what each cache hands to attention (4 rows at different positions)."""
    heads, hd, max_len = 2, 4, 64
    ring = RingCache(4, max_len, heads, hd, torch.float32, "cpu", CHUNK)
    prefix = PrefixCache(4, max_len, heads, hd, torch.float32, "cpu")
    assert ring.store.k.shape[1] == CHUNK
    pos = torch.tensor([[3], [9], [17], [20]])
    k = torch.randn(4, 1, heads, hd)
    keys, _, mask = ring.update(k, k, Step(pos))
    assert keys.shape[1] == 5 and mask.shape[-1] == 5  # slots 0..4: the furthest row is 4 into its chunk
    assert mask[:, 0, 0].sum(-1).tolist() == [4, 2, 2, 5]
    keys, _, mask = prefix.update(k, k, Step(pos))
    assert keys.shape[1] == 21 and mask[:, 0, 0].sum(-1).tolist() == [4, 10, 18, 21]


def test_matches_transformers_with_chunk_16_and_100_token_prompts(ckpt_root, dist1):
    """Two 100-token prompts: prefilled at once, and as 37 tokens, 40 from mid-chunk, then 23
    decoded one by one; against Llama4ForCausalLM's full forward (fp32 on both sides)."""
    from test_model_reference import hf_model

    path = make_checkpoint(ckpt_root, "hf-chunk16", preset="tiny", seed=4, fmt="hf",
                           overrides=dict(attention_chunk_size=16))
    ours = build(path, dtype=torch.float32, max_batch_size=2)
    ref = hf_model(path).float()
    tokens = torch.randint(0, 200000, (2, 100), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        want = ref(input_ids=tokens, use_cache=False).logits.float()
    scale = want.abs().max()
    assert (ours.model(tokens, 0) - want).abs().max() <= 1e-4 * scale
    parts = [ours.model(tokens[:, :37], 0), ours.model(tokens[:, 37:77], 37)]
    parts += [ours.model(tokens[:, t : t + 1], t) for t in range(77, 100)]
    got = torch.cat(parts, dim=1)
    assert (got - want).abs().max() <= 1e-4 * scale
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_fp8_cache_logits_error_and_size(tiny_ckpt, pair, dist1):
    """fp8 (e4m3, a scale per token and KV head) against bf16 KV on the same bf16 model, 3 chunks
    prefilled and 2 decoded. Measured: max |logit difference| 0.23, mean 0.03 (logits up to |10|),
    the same greedy token at all 40 positions; for scale, this bf16 model differs from its fp32 run
    by up to 0.09. (On the fp32 model: fp8 KV 0.24, bf16 KV 0.014.)"""
    calls = three_chunks_then_two_decoded()
    fp8 = build(tiny_ckpt, dtype=torch.bfloat16, kv_cache_dtype="fp8")
    assert fp8.model.layers[0].attention.cache_k.dtype == FP8
    got = torch.cat(run_script_of_calls(fp8.model, calls), dim=1)
    want = torch.cat(run_script_of_calls(pair[torch.bfloat16, "by_kind"].model, calls), dim=1)
    err = (got - want).abs().max().item()
    assert err <= 0.5
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    # Half of bf16, plus one fp32 scale per token and head: (32 + 4) / 64 at the tiny preset's head_dim 32.
    bf16_bytes = pair[torch.bfloat16, "by_kind"].model.kv_cache_bytes()
    assert fp8.model.kv_cache_bytes() == fp8.kv_cache_bytes == bf16_bytes * 36 // 64


_RSS_PROBE = """
import json, sys, torch
from llama_lite.distributed import init_distributed
from llama_lite.generation import Llama4

def vm_rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

init_distributed(1, "cpu")
llama = Llama4.build(sys.argv[1], max_seq_len=int(sys.argv[2]), max_batch_size=int(sys.argv[3]))
measured, kept = {"kv_cache_bytes": llama.kv_cache_bytes}, []
for layout in ("by_kind", "full"):
    # Earlier caches stay alive, so each allocation is fresh memory (not pages freed a moment ago).
    kept.append([layer.attention.cache for layer in llama.model.layers])
    before = vm_rss()
    llama.model.setup_caches(torch.bfloat16, "cpu", layout)
    measured[layout] = vm_rss() - before
print(json.dumps(measured))
"""


def test_kv_cache_resident_memory_follows_the_formula(ckpt_root):
    """max_seq_len = 64 chunks: the resident memory the caches add is at most 1.2x (global layers x
    max_seq_len + chunked layers x chunk); the full layout, measured the same way, is about 2x that.
    Measured in a process of its own: in the test process, memory that earlier tests freed is
    reused without growing the resident set."""
    chunk, seq_len, batch = 256, 64 * 256, 8
    path = make_checkpoint(ckpt_root, "tiny-chunk256", preset="tiny", seed=0,
                           overrides=dict(attention_chunk_size=chunk))
    args = args_from_params(json.loads((path / "params.json").read_text()), max_seq_len=seq_len, max_batch_size=batch)
    per_position = 2 * args.n_kv_heads * args.head_dim * 2  # K and V, bf16
    n_global = sum(args.is_nope_layer(i) for i in range(args.n_layers))
    formula = batch * per_position * (n_global * seq_len + (args.n_layers - n_global) * chunk)
    assert kv_cache_bytes(args, seq_len, batch, torch.bfloat16) == formula

    proc = run_ranks(1, ["-c", _RSS_PROBE, str(path), str(seq_len), str(batch)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    assert measured["kv_cache_bytes"] == formula
    assert 0.8 * formula <= measured["by_kind"] <= 1.2 * formula
    assert measured["full"] >= 1.8 * formula  # the layout every layer had before: max_seq_len everywhere


def test_memory_check_names_what_fits():
    from llama_lite.errors import ConfigError
    from llama_lite.memory import check_fits
    from llama_lite.synthetic import preset_args

    args = preset_args("small", max_seq_len=1_000_000, max_batch_size=8)
    weights = 300 << 20
    need = kv_cache_bytes(args, args.max_seq_len, 8, torch.bfloat16)
    assert check_fits(args, weights, weights + need, torch.bfloat16, "by_kind", 1) == need
    with pytest.raises(ConfigError) as e:
        check_fits(args, weights, weights + need - 1, torch.bfloat16, "by_kind", 1)
    fit = int(e.value.args[0].split("max_seq_len ")[-1].split()[0])
    assert kv_cache_bytes(args, fit, 8, torch.bfloat16) + weights <= weights + need - 1
    assert kv_cache_bytes(args, fit + 1, 8, torch.bfloat16) + weights > weights + need - 1
    with pytest.raises(ConfigError, match="weights alone do not fit"):
        check_fits(args, weights, weights // 2, torch.bfloat16, "by_kind", 1)


def test_a_cache_larger_than_memory_is_refused_in_one_line(run_script, tiny_ckpt):
    """What a user tries: a context no machine here holds. One sentence, exit 2, before any allocation."""
    got = run_script("scripts.completion", tiny_ckpt, "--prompt", "hi", "--max_seq_len", 10**10,
                     "--max_batch_size", 8, timeout=120)
    assert got.returncode == 2, got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: a KV cache of max_seq_len 10000000000"), got.stderr
    assert "would fit" in lines[0] and "available" in lines[0]
    assert ". " not in lines[0] and got.stdout == ""


def test_conversation_continues_exactly_as_a_fresh_prefill(tiny_ckpt, dist1):
    """5 turns, greedy fp32 (chunk 8: the conversation crosses many chunk boundaries, and turns
    start mid-chunk). Each turn prefills only its new tokens and gives the tokens a fresh prefill
    of the whole conversation gives."""
    llama = build(tiny_ckpt, dtype=torch.float32, max_seq_len=512, max_batch_size=1)
    chat = llama.conversation(system="Be brief")
    turns = []
    for i, text in enumerate(["hello there", "tell me more", "x", "why, really, in some detail?", "ok, thanks"]):
        before = len(chat.tokens)
        reply = [s[0].token for s in chat.send(text, temperature=0, max_gen_len=9 + i) if s[0].source == "output"]
        prompt = chat.tokens[: len(chat.tokens) - len(reply)]
        if i:
            # Prefilled: the last reply's final token (generated, never fed back) and this turn's tokens.
            assert chat.last_prefill == len(prompt) - before + 1
        turns.append((prompt, reply))
    assert len(turns[-1][0]) > 8 * CHUNK
    for prompt, reply in turns:  # fresh prefills of each whole conversation (this resets the row)
        assert llama.generate_tokens([prompt], temperature=0, max_gen_len=len(reply))[0] == reply
    # A fresh generation took the row: the next turn notices and prefills everything again.
    reply = [s[0].token for s in chat.send("again", temperature=0, max_gen_len=2) if s[0].source == "output"]
    assert chat.last_prefill == len(chat.tokens) - len(reply) > 8 * CHUNK
