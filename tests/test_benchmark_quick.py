"""scripts/benchmark.py --quick end to end on the tiny checkpoint, so the benchmark never rots."""

import importlib.util
import json
import subprocess
import sys

from helpers import ROOT

KEYS = ("decode_b1_tok_s", "decode_b8_tok_s", "prefill_tok_s", "ttft_s", "load_s", "bytes_per_token",
        "roofline_tok_s", "roofline_pct", "stream_gb_s", "load_peak_rss_gib", "run_peak_rss_gib", "weights_gib",
        "kv_cache_gib")


def test_benchmark_quick(tmp_path, tiny_ckpt):
    out, plot = tmp_path / "results.json", tmp_path / "bench.png"
    # bf16 and int4 of every target (plain and with int8 activations): the plain and the quantized
    # loader, all module kinds.
    cmd = [sys.executable, "-m", "scripts.benchmark", "--quick", "--checkpoint", str(tiny_ckpt),
           "--modes", "bf16,int4_all,int4_all_a8", "--threads", "1", "--out", str(out), "--plot", str(plot)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [(r["engine"], r["mode"]) for r in data["results"]] == [
        ("llama-lite", "bf16"), ("llama-lite", "int4_all"), ("llama-lite", "int4_all_a8")]
    for r in data["results"]:
        assert "error" not in r, r["error"]
        assert all(r[k] is not None and r[k] > 0 for k in KEYS), {k: r.get(k) for k in KEYS}
        assert r["bytes_per_token_parts"]["output"] > 0
    bf16, int4, int4_a8 = data["results"]
    assert int4_a8["bytes_per_token"] == int4["bytes_per_token"]  # the same weights
    assert int4["bytes_per_token"] < bf16["bytes_per_token"] / 3  # int4 everywhere: ~4x fewer bytes per token
    assert "| llama-lite | bf16 |" in proc.stdout
    # Without --llama_cpp no llama.cpp row, ratio or figure: nothing is guessed.
    assert "llama.cpp" not in proc.stdout and "llama_cpp" not in data
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.stat().st_size > 0
