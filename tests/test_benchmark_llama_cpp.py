"""scripts.benchmark --llama_cpp without a real llama.cpp: fake llama-bench / llama-quantize / converter
scripts check the arguments they get and write small files, so finding the tools, the cached
conversions, llama-bench's JSON and the ratios are tested in seconds."""

import json
import os
import sys
import textwrap

import pytest

from scripts import bench_llama_cpp, benchmark
from scripts import common
from scripts.common import FlagError, run_cli

# llama-bench -o json: one object per test (fields as tools/llama-bench prints them, trimmed).
FAKE_BENCH = '''
import json, os, signal, sys
args = sys.argv[1:]
if args == ["--help"]:
    sys.exit(print("  -lm, --load-mode <auto|none|mmap|mlock|mmap+mlock|dio> (default: auto)"))
opts = dict(zip(args[::2], args[1::2]))
open({log!r}, "a").write("bench " + " ".join(args) + "\\n")
need = {{"-t": "1", "-n": "6", "-r": "1", "-lm": "none", "-o": "json"}}
if any(opts.get(k) != v for k, v in need.items()) or opts.get("-p") not in ("0", "64") or not opts.get("-m", "").endswith(".gguf"):
    sys.exit("fake llama-bench: unexpected arguments " + " ".join(args))
if os.environ.get("FAKE_SIGILL") and opts["-m"].endswith(os.environ["FAKE_SIGILL"]):
    os.kill(os.getpid(), signal.SIGILL)
speed = {{"bf16.gguf": 10.0, "q8_0.gguf": 20.0, "q4_0.gguf": 40.0}}[opts["-m"].rsplit("/", 1)[-1]]
common = {{"build_commit": "fake123", "build_number": 4242, "cpu_info": "Fake CPU", "model_type": "llama4 ?B",
           "model_size": 3 * 1024**3, "model_n_params": 100, "n_threads": 1, "n_depth": 0, "avg_ns": 1}}
print("a log line before the JSON")
if opts["-p"] == "0":  # an interleaved decode run: each one slower than the last
    n = len([line for line in open({log!r}) if line.startswith("bench") and " -p 0 " in line])
    speed /= n
tests = [{{**common, "n_prompt": 0, "n_gen": 6, "avg_ts": speed, "stddev_ts": 0.5, "samples_ts": [speed]}}]
if opts["-p"] != "0":
    tests.insert(0, {{**common, "n_prompt": 64, "n_gen": 0, "avg_ts": 10 * speed, "stddev_ts": 1.0, "samples_ts": [10 * speed]}})
print(json.dumps(tests, indent=2))
'''

FAKE_QUANTIZE = '''
import os, sys
src, out, kind, threads = sys.argv[1:]
open({log!r}, "a").write(f"quantize {{kind}}\\n")
assert src.endswith("bf16.gguf") and threads == "1", sys.argv
open(out, "w").write("partial")
if os.environ.get("FAKE_FAIL") == kind:
    sys.exit("fake llama-quantize: failing on purpose")
open(out, "a").write(kind)
'''

FAKE_CONVERT = '''
import os, sys
args = sys.argv[1:]
folder = args[-1]
open({log!r}, "a").write("convert " + " ".join(args[:-1]) + "\\n")
names = set(os.listdir(folder))
if not {{"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"}} <= names or "tokenizer.model" in names:
    sys.exit(f"fake converter: unexpected input {{sorted(names)}}")
assert args[:2] == ["--outtype", "bf16"] and args[2] == "--outfile", args
open(args[3], "w").write("gguf")
'''


def _script(path, body):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_llama_cpp(tmp_path):
    """(build folder, call log): bin/ with fake llama-bench and llama-quantize, the converter one up."""
    log = tmp_path / "calls.log"
    log.write_text("")
    build = tmp_path / "llama.cpp" / "build"
    _script(build / "bin" / "llama-bench", FAKE_BENCH.format(log=str(log)))
    _script(build / "bin" / "llama-quantize", FAKE_QUANTIZE.format(log=str(log)))
    _script(tmp_path / "llama.cpp" / "convert_hf_to_gguf.py", FAKE_CONVERT.format(log=str(log)))
    return build, log


@pytest.fixture
def hf_export(tmp_path, monkeypatch):
    """A Hugging Face folder as the export has it (the weights a stand-in: no engine runs here); the
    tokenizer.json the conversion makes is a stub (the real one takes ~15 s: test_tokenizer_json)."""
    from llama_lite.synthetic import hf_config, preset_args

    hf = tmp_path / "tiny-hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(hf_config(preset_args("tiny"))))
    (hf / "model.safetensors").write_text("weights")
    (hf / "tokenizer.model").write_text("ranks")

    def stub(model, out_dir):
        assert model == hf / "tokenizer.model"
        (out_dir / "tokenizer_config.json").write_text("{}")
        (out_dir / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(bench_llama_cpp, "write_tokenizer_json", stub)
    return hf


def _run(hf, build, tmp_path, capsys):
    out = tmp_path / "results.json"
    benchmark.main(checkpoint=str(hf), modes="", quick=True, threads=1, llama_cpp=str(build), out=str(out), plot="")
    return json.loads(out.read_text()), capsys.readouterr().out


def _calls(log):
    return [line.split()[0] for line in log.read_text().splitlines()]


def test_llama_cpp_rows_and_the_cache(fake_llama_cpp, hf_export, tmp_path, capsys):
    build, log = fake_llama_cpp
    data, stdout = _run(hf_export, build, tmp_path, capsys)
    rows = [r for r in data["results"] if r["engine"] == "llama.cpp"]
    assert [r["mode"] for r in rows] == ["bf16", "Q8_0", "Q4_0"]
    assert all("error" not in r for r in rows), rows
    assert [(r["decode_b1_tok_s"], r["prefill_tok_s"]) for r in rows] == [(10, 100), (20, 200), (40, 400)]
    assert rows[0]["decode_b1_stddev"] == 0.5 and rows[0]["gguf_gib"] == 3
    assert data["llama_cpp"]["version"]["build_commit"] == "fake123"
    assert data["llama_cpp"]["version"]["build_number"] == 4242
    assert data["llama_cpp"]["ratios"] == []  # no llama-lite mode ran
    assert "| llama.cpp | Q4_0 | 40.00 |" in stdout and "build fake123 (4242)" in stdout
    assert _calls(log) == ["convert", "quantize", "quantize", "bench", "bench", "bench"]
    cache = hf_export.parent / "tiny-hf-gguf"
    assert sorted(p.name for p in cache.glob("*.gguf")) == ["bf16.gguf", "q4_0.gguf", "q8_0.gguf"]
    assert (cache / "q4_0.gguf").read_text() == "partialQ4_0"
    assert not (hf_export / "tokenizer.json").exists()  # the export is left as it is

    log.write_text("")
    _run(hf_export, build, tmp_path, capsys)
    assert _calls(log) == ["bench", "bench", "bench"]  # converted once

    # An export rewritten after the conversion is converted again.
    before = (hf_export / "model.safetensors").stat().st_mtime - 10
    os.utime(cache / "bf16.gguf", (before, before))
    log.write_text("")
    _run(hf_export, build, tmp_path, capsys)
    assert _calls(log) == ["convert", "quantize", "quantize", "bench", "bench", "bench"]


def test_a_failed_quantization_leaves_nothing_and_the_rest_runs(fake_llama_cpp, hf_export, tmp_path, capsys,
                                                                monkeypatch):
    build, log = fake_llama_cpp
    monkeypatch.setenv("FAKE_FAIL", "Q4_0")
    data, stdout = _run(hf_export, build, tmp_path, capsys)
    rows = {r["mode"]: r for r in data["results"]}
    assert "failing on purpose" in rows["Q4_0"]["error"] and "error" not in rows["Q8_0"]
    cache = hf_export.parent / "tiny-hf-gguf"
    assert not list(cache.glob("q4_0*"))  # neither the file nor its partial temporary
    assert "| llama.cpp | Q4_0 | error:" in stdout

    monkeypatch.delenv("FAKE_FAIL")
    log.write_text("")
    data, _ = _run(hf_export, build, tmp_path, capsys)
    assert _calls(log) == ["quantize", "bench", "bench", "bench"]
    assert all("error" not in r for r in data["results"])


def test_a_crashed_llama_bench_names_its_signal_and_the_rest_runs(fake_llama_cpp, hf_export, tmp_path, capsys,
                                                                    monkeypatch):
    build, _ = fake_llama_cpp
    monkeypatch.setenv("FAKE_SIGILL", "q8_0.gguf")
    data, stdout = _run(hf_export, build, tmp_path, capsys)
    rows = {r["mode"]: r for r in data["results"]}
    assert rows["Q8_0"]["error"].startswith("llama-bench was killed by SIGILL"), rows["Q8_0"]
    assert "without AMX" in rows["Q8_0"]["error"]
    assert "error" not in rows["bf16"] and rows["Q4_0"]["decode_b1_tok_s"] == 40
    assert "| llama.cpp | Q8_0 | error: llama-bench was killed by SIGILL" in stdout


def test_exit_reason():
    assert bench_llama_cpp.exit_reason(3) == "exited with status 3"
    assert bench_llama_cpp.exit_reason(-11) == "was killed by SIGSEGV"
    assert "SIGILL" in bench_llama_cpp.exit_reason(-4)


def _row(engine: str, mode: str, decode: float, prefill: float, **more) -> dict:
    """A result row of the benchmark: decode at batch 1 and prefill tokens/s."""
    return {"engine": engine, "mode": mode, "decode_b1_tok_s": decode, "prefill_tok_s": prefill, **more}


def test_parse_bench_json_and_ratios():
    tests = [{"n_prompt": 512, "n_gen": 0, "avg_ts": 60.0, "stddev_ts": 30.0, "samples_ts": [82, 18, 80],
              "build_commit": "abc", "build_number": 7},
             {"n_prompt": 0, "n_gen": 24, "avg_ts": 8.0, "stddev_ts": 0.1, "samples_ts": [8, 8]}]
    row = bench_llama_cpp.parse_bench_json(json.dumps(tests), 512, 24)
    assert (row["prefill_tok_s"], row["prefill_mean"], row["decode_b1_tok_s"]) == (80, 60, 8)  # median of the runs
    assert (row["prefill_runs"], row["build_commit"], row["build_number"]) == ([82, 18, 80], "abc", 7)
    with pytest.raises(ValueError, match="tg6"):
        bench_llama_cpp.parse_bench_json(json.dumps(tests), 512, 6)
    with pytest.raises(ValueError, match="no JSON"):
        bench_llama_cpp.parse_bench_json("error: no model", 512, 24)

    lite = lambda mode, d, p: _row("llama-lite", mode, d, p)  # noqa: E731
    cpp = lambda mode, d, p: _row("llama.cpp", mode, d, p)  # noqa: E731
    pair = {"mode": "Q8_0", "ratios": [0.9, 1.2, 1.0]}  # int4_mixed's interleaved runs
    results = [lite("bf16", 6, 40), {**lite("int4_mixed", 9, 30), "llama_cpp_pair": pair},
               {**lite("int4_all", 1, 1), "error": "x"}, cpp("bf16", 4, 80), cpp("Q8_0", 12, 60), cpp("Q4_0", 16, 90)]
    assert bench_llama_cpp.ratios(results) == [
        {"llama_lite": "bf16", "llama_cpp": "bf16", "decode_b1": 1.5, "prefill": 0.5, "decode_b1_interleaved": None},
        {"llama_lite": "int4_mixed", "llama_cpp": "Q8_0", "decode_b1": 0.75, "prefill": 0.5,
         "decode_b1_interleaved": 1.0, "decode_b1_interleaved_range": [0.9, 1.2], "decode_b1_interleaved_runs": 3},
    ]  # int4_all did not run: no pair
    # a pair recorded for another format is not taken for this one; interleaved runs alone make a row
    results[1]["llama_cpp_pair"] = {**pair, "mode": "Q4_0"}
    assert bench_llama_cpp.ratios(results)[1]["decode_b1_interleaved"] is None
    results[1]["llama_cpp_pair"] = pair
    assert [r["llama_lite"] for r in bench_llama_cpp.ratios(results[:3])] == ["int4_mixed"]
    notes = benchmark.llama_cpp_notes(bench_llama_cpp.Tools(*["x"] * 3), bench_llama_cpp.ratios(results), None,
                                      {"threads": 2, "prefill_len": 512, "decode_tokens": 24, "llama_cpp_runs": 5})
    assert "| bf16 | bf16 | - | 1.50x | 0.50x |" in notes and "-p 512 -n 24" in notes
    assert "| int4_mixed | Q8_0 | 1.00x (0.90-1.20, 3) | 0.75x | 0.50x |" in notes and "-p 0 -n 24 -r 1" in notes


def test_targets_against_llama_cpp():
    """The acceptance targets against llama.cpp come from the measured ratios: decode by the
    interleaved median where there is one, else the separate runs; prefill by the separate runs;
    nothing where llama.cpp did not run."""
    lite = lambda mode, d, p, pct: _row("llama-lite", mode, d, p, roofline_pct=pct)  # noqa: E731
    cpp = lambda mode, d, p: _row("llama.cpp", mode, d, p)  # noqa: E731
    results = [lite("bf16", 12, 300, 90), lite("int4_mixed", 20, 250, 65),
               {**lite("int4_all", 40, 200, 69), "llama_cpp_pair": {"mode": "Q4_0", "ratios": [1.2, 1.4, 1.35]}},
               cpp("bf16", 13, 140), cpp("Q8_0", 18, 80), cpp("Q4_0", 20, 150)]
    got = {t["target"]: (round(t["value"], 4), t["goal"], t["met"]) for t in benchmark.check_targets(results, "bench")}
    assert got["bf16 vs llama.cpp bf16: decode b1, separate runs"] == (round(12 / 13, 4), 1.0, False)
    assert got["bf16 vs llama.cpp bf16: prefill"] == (round(300 / 140, 4), 2.0, True)
    assert got["int4_mixed vs llama.cpp Q8_0: decode b1, separate runs"] == (round(20 / 18, 4), 1.0, True)
    assert "int4_mixed vs llama.cpp Q8_0: prefill" not in got  # no goal
    assert got["int4_all vs llama.cpp Q4_0: decode b1, interleaved"] == (1.35, 1.3, True)
    assert got["int4_all vs llama.cpp Q4_0: prefill"] == (round(200 / 150, 4), 1.5, False)
    assert got["bf16 decode % of roofline"] == (90, 85, True)
    assert got["int4_all decode % of roofline"] == (69, 70, False)
    assert got["int4_mixed decode % of roofline"] == (65, 60, True)
    without = [r for r in results if r["engine"] != "llama.cpp"]
    without[2] = {k: v for k, v in without[2].items() if k != "llama_cpp_pair"}
    assert not [t for t in benchmark.check_targets(without, "bench") if "llama.cpp" in t["target"]]


def test_interleaved_decode_runs(fake_llama_cpp, hf_export, tiny_ckpt, tmp_path, capsys):
    """A llama-lite mode's decode runs each followed by one llama-bench decode run of its pair, the
    ratio per neighbouring pair (the fake llama-bench slows down run by run: 20, 10, ... tok/s)."""
    build, log = fake_llama_cpp
    out = tmp_path / "results.json"
    benchmark.main(checkpoint=str(tiny_ckpt), hf_checkpoint=str(hf_export), modes="int4_mixed", quick=True,
                   threads=1, llama_cpp=str(build), out=str(out), plot="")
    data = json.loads(out.read_text())
    lite = next(r for r in data["results"] if r["engine"] == "llama-lite")
    assert "error" not in lite, lite
    pair = lite["llama_cpp_pair"]
    runs = benchmark.QUICK["decode_runs"]
    assert pair["mode"] == "Q8_0" and pair["peer_tok_s"] == [20.0 / (i + 1) for i in range(runs)]
    assert pair["lite_tok_s"] == lite["decode_b1_runs"]
    assert pair["ratios"] == [a / b for a, b in zip(pair["lite_tok_s"], pair["peer_tok_s"])]
    interleaved = [line for line in log.read_text().splitlines() if " -p 0 " in line]
    assert len(interleaved) == runs and all("q8_0.gguf" in line and "-r 1" in line for line in interleaved)
    row = next(r for r in data["llama_cpp"]["ratios"] if r["llama_lite"] == "int4_mixed")
    assert row["decode_b1_interleaved"] == pytest.approx(sorted(pair["ratios"])[runs // 2] if runs % 2 else
                                                         sum(sorted(pair["ratios"])[runs // 2 - 1:runs // 2 + 1]) / 2)
    assert "interleaved runs" in capsys.readouterr().out


def test_the_bench_preset_is_the_model_llama_cpp_runs():
    from llama_lite.synthetic import hf_config, preset_args

    assert bench_llama_cpp.differences(hf_config(preset_args("bench"))) == []
    tiny = bench_llama_cpp.differences(hf_config(preset_args("tiny")))
    assert any("attention_chunk_size 8" in d for d in tiny) and any("NoPE" in d for d in tiny)


def test_missing_llama_cpp_tools_are_one_line_errors(tmp_path, monkeypatch, capsys):
    with pytest.raises(FlagError, match="bin/llama-bench.*bin/llama-quantize.*convert_hf_to_gguf.py"):
        bench_llama_cpp.find_tools(str(tmp_path))
    with pytest.raises(FlagError, match="needs a llama.cpp build folder"):
        bench_llama_cpp.find_tools("")
    # The command line, as `python -m scripts.benchmark` runs it (in this process: no second torch import).
    monkeypatch.setattr(sys, "argv", ["benchmark", "--quick", "--llama_cpp", str(tmp_path / "nope")])
    # run_cli ends a script by destroying the process group; the suite's own must outlive this call
    monkeypatch.setattr(common, "_shutdown_distributed", lambda: None)
    with pytest.raises(SystemExit) as info:
        run_cli(benchmark.main)
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: --llama_cpp {tmp_path / 'nope'} is not a folder "
                                                    "(give a llama.cpp build folder; see README)"]


@pytest.mark.slow
def test_tokenizer_json(tmp_path):
    """The tokenizer.json made for the converter gives llama-lite's ids (BOS first), special tokens included."""
    pytest.importorskip("tokenizers")
    from transformers import AutoTokenizer

    from llama_lite.tokenizer import Tokenizer, default_tokenizer_path

    bench_llama_cpp.write_tokenizer_json(default_tokenizer_path(), tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer.from_default()
    for text in ["Hello, world! I'm sure you'll LIKE it.\n\n  \t indented", "3.14159 12345678 ---=== ...!!",
                 "Grüße, нещо на Български, 我想在apple工作 🦙🦙", "<|header_start|>user<|header_end|>\n\nhi<|eot|>"]:
        assert hf.encode(text) == ours.encode(text, bos=True, eos=False, allowed_special="all"), text
    assert hf.convert_ids_to_tokens(200000) == "<|begin_of_text|>" and len(hf) == 202048


def test_pairing_is_skipped_when_both_models_would_not_fit():
    """memory_left_for: None when this process, the GGUF and 2 GiB fit in the machine's memory, a
    reason naming the sizes when they do not."""
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert bench_llama_cpp.memory_left_for({"mode": "Q4_0", "gguf_bytes": 1024**2}, 1024**3) is None
    reason = bench_llama_cpp.memory_left_for({"mode": "bf16", "gguf_bytes": total}, 1024**3)
    assert reason is not None and reason.startswith("not interleaved") and "llama.cpp's bf16" in reason
