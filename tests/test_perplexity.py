"""scripts.perplexity: perplexity, KL divergence and top-1 agreement against torch's own definitions."""

import torch
import torch.nn.functional as F

from scripts.perplexity import main, score, windows

TEXT = ("The quick brown fox jumps over the lazy dog while the model predicts every next token it can. " * 6)


def _log_probs(llama, w):
    first = len(w) // 2
    with torch.no_grad():
        return torch.log_softmax(llama.model(w[None], 0)[0, first:-1].float(), -1)


def test_scores_match_torch(tiny_llama, tiny_llama_fp32, tmp_path):
    tok = tiny_llama.tokenizer
    wins = windows(tok.encode(TEXT, bos=False, eos=False), 32, tok.bos_id, chunks=3)
    assert len(wins) == 3 and all(len(w) == 32 and w[0] == tok.bos_id for w in wins)
    base = score(tiny_llama, wins, tmp_path, None)
    nll = torch.cat([F.cross_entropy(_log_probs(tiny_llama, w), w[17:], reduction="none") for w in wins])
    assert base["tokens"] == 3 * 15
    assert abs(base["ppl"] - nll.double().mean().exp().item()) <= 1e-6 * base["ppl"]
    # the fp32 run of the same weights as "the quantized model" against the stored bf16 base
    other = score(tiny_llama_fp32, wins, tmp_path, tmp_path)
    lp_b = torch.cat([_log_probs(tiny_llama, w) for w in wins])
    lp_q = torch.cat([_log_probs(tiny_llama_fp32, w) for w in wins])
    kl = F.kl_div(lp_q, lp_b, log_target=True, reduction="none").sum(-1).double()
    assert abs(other["kld_mean"] - kl.mean().item()) <= 1e-6 + 1e-4 * kl.mean().item()
    assert abs(other["kld_p99"] - torch.quantile(kl, 0.99).item()) <= 1e-6 + 1e-4 * kl.max().item()
    assert other["top1"] == (lp_b.argmax(-1) == lp_q.argmax(-1)).double().mean().item()
    assert 0 < other["kld_mean"] and other["top1"] > 0.5  # bf16 vs fp32: close, not equal


def test_table_and_flags(tiny_ckpt, tmp_path, run_script, capsys, dist1):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    main(str(tiny_ckpt), text=str(text), ctx=32, chunks=2, quantization_mode="none,fp8_mixed")
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| tiny |")]
    assert [r.split("|")[2].strip() for r in rows] == ["none", "fp8_mixed"], out
    none, fp8 = ([c.strip() for c in r.split("|")[3:7]] for r in rows)
    assert none[1:] == ["0.00000", "0.00000", "100.00%"]
    assert float(fp8[1]) > 0 and float(fp8[0]) > 1
    short = run_script("scripts.perplexity", tiny_ckpt, "--text", text, "--ctx", 4096, timeout=120)
    assert short.returncode == 2 and "fewer than one window of --ctx 4096" in short.stderr, short.stderr
