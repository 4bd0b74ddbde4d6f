"""llama.cpp measured beside llama-lite in ``scripts.benchmark --llama_cpp DIR``.

DIR is a llama.cpp build folder (``bin/llama-bench`` and ``bin/llama-quantize``, or the two
directly in it) inside, or beside, the llama.cpp source that has ``convert_hf_to_gguf.py``. The
benchmark's Hugging Face export is converted once to GGUF bf16 (the source's converter, run with
this Python), then to Q8_0 and Q4_0 (``llama-quantize``, its default recipe per type), cached in
``<export>-gguf/`` beside the export. ``llama-bench`` then measures decode at batch 1 (``-n``) and
prefill (``-p``) of each with the benchmark's threads and lengths.

Decode is also measured *interleaved*: while a llama-lite mode's worker has its model loaded, each of
its decode runs is followed by one llama-bench decode run of the paired format (``PAIRS``), and the
ratio is taken per pair of neighbouring runs. On a shared machine the memory bandwidth can move by 2x
within minutes (measured: a streaming read at 30 and at 60 GB/s in one sitting); runs minutes apart
then compare two machines, neighbouring runs compare the engines.

Nothing of llama.cpp is vendored here: this module only runs its tools and reads their output.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from scripts.common import FlagError
from scripts.machine_load import OtherLoad, wait_for_quiet

# llama.cpp's formats, each with the llama-lite mode it is compared with.
FORMATS = ("bf16", "Q8_0", "Q4_0")
PAIRS = (("bf16", "bf16"), ("int4_mixed", "Q8_0"), ("int4_all", "Q4_0"), ("int4_mixed_a8", "Q8_0"), ("int4_all_a8", "Q4_0"))
ENGINE = "llama.cpp"


@dataclass(frozen=True)
class Tools:
    bench: Path
    quantize: Path
    convert: Path


def _executable(folder: Path, name: str) -> Optional[Path]:
    for path in (folder / "bin" / name, folder / name):
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def find_tools(folder: str) -> Tools:
    """The build folder's llama-bench and llama-quantize, and the source's converter (in the folder or
    its parent); a FlagError naming what is missing."""
    if not folder:
        raise FlagError("--llama_cpp needs a llama.cpp build folder (see README)")
    build = Path(folder).expanduser()
    if not build.is_dir():
        raise FlagError(f"--llama_cpp {build} is not a folder (give a llama.cpp build folder; see README)")
    bench, quantize = _executable(build, "llama-bench"), _executable(build, "llama-quantize")
    convert = next((p for p in (build / "convert_hf_to_gguf.py", build.parent / "convert_hf_to_gguf.py")
                    if p.is_file()), None)
    missing = [what for what, found in (("bin/llama-bench", bench), ("bin/llama-quantize", quantize),
                                        ("convert_hf_to_gguf.py in it or its parent", convert)) if found is None]
    if missing:
        raise FlagError(f"--llama_cpp {build} has no {', no '.join(missing)} (a llama.cpp build folder, built "
                        "with the llama-bench and llama-quantize targets, inside its source; see README)")
    assert bench and quantize and convert
    return Tools(bench.resolve(), quantize.resolve(), convert.resolve())


# ---- the model llama.cpp reads ------------------------------------------------------------------


def differences(config: dict) -> list[str]:
    """What llama.cpp's Llama 4 graph fixes instead of reading from the GGUF (src/models/llama4.cpp:
    8192-token chunks, a NoPE layer every 4th, temperature tuning with floor 8192 and scale 0.1,
    QK norm unless 128 experts, shared expert as wide as a routed one), where this checkpoint differs:
    llama.cpp would then time a slightly different model. The bench preset matches it."""
    text = config.get("text_config", config)
    n = text["num_hidden_layers"]
    out = []
    if text.get("attention_chunk_size") != 8192:
        out.append(f"attention_chunk_size {text.get('attention_chunk_size')} (llama.cpp: 8192)")
    nope = [i for i, rope in enumerate(text.get("no_rope_layers") or []) if not rope]
    if nope != [i for i in range(n) if (i + 1) % 4 == 0]:
        out.append(f"NoPE layers {nope} (llama.cpp: every 4th)")
    if not text.get("attn_temperature_tuning", True):
        out.append("no attention temperature tuning (llama.cpp: always on)")
    elif (text.get("floor_scale", 8192), text.get("attn_scale", 0.1)) != (8192, 0.1):
        out.append(f"floor_scale {text.get('floor_scale')}, attn_scale {text.get('attn_scale')} "
                   "(llama.cpp: 8192, 0.1)")
    if bool(text.get("use_qk_norm")) != (text.get("num_local_experts") != 128):
        out.append(f"use_qk_norm {text.get('use_qk_norm')} (llama.cpp: on unless 128 experts)")
    return out


def write_tokenizer_json(tokenizer_model: Path, out_dir: Path) -> None:
    """tokenizer.json and tokenizer_config.json for the converter, from the tiktoken tokenizer.model by
    transformers' TikTokenConverter, with llama-lite's split pattern and special tokens (ids 200000+) and
    <|begin_of_text|> prepended as Hugging Face's Llama 4 tokenizer does. Its ids equal llama-lite's, and
    the converter recognises its pre-tokenizer as llama4's (it hashes the ids of a test string)."""
    from tokenizers import processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from llama_lite.tokenizer import SPLIT_PATTERN, special_token_names

    names = special_token_names()
    tok = TikTokenConverter(vocab_file=str(tokenizer_model), pattern=SPLIT_PATTERN,
                            extra_special_tokens=names).converted()
    bos = "<|begin_of_text|>"
    if tok.token_to_id(bos) != tok.get_vocab_size() - len(names):
        raise ValueError(f"{tokenizer_model}: special tokens did not land at ids {tok.get_vocab_size() - len(names)}+")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                                      special_tokens=[(bos, tok.token_to_id(bos))]),
    ])
    tmp = out_dir / "tokenizer.json.part"
    tok.save(str(tmp))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": "<|eot|>",
              "pad_token": "<|finetune_right_pad|>", "add_bos_token": True, "model_max_length": 10485760}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out_dir / "tokenizer.json")


def converter_input(hf: Path, cache: Path, say: Callable[[str], None]) -> Path:
    """The folder the converter reads: links to the export's files, and a tokenizer.json (made once)
    when the export has none (synthetic exports carry only the tiktoken tokenizer.model). The export
    itself is left as it is."""
    folder = cache / "hf"
    folder.mkdir(parents=True, exist_ok=True)
    has_json = (hf / "tokenizer.json").exists()
    for entry in folder.iterdir():
        if entry.is_symlink() or (has_json and entry.name.startswith("tokenizer")):  # links, or a made tokenizer
            entry.unlink()
    for f in hf.iterdir():
        # Llama 4's converter reads tokenizer.json only: tokenizer.model stays out, and without a
        # tokenizer.json of the export's own, the made one brings its tokenizer_config.json.
        if f.is_file() and f.name != "tokenizer.model" and (has_json or not f.name.startswith("tokenizer")):
            (folder / f.name).symlink_to(f.resolve())
    if not has_json and not (folder / "tokenizer.json").exists():
        if not (hf / "tokenizer.model").exists():
            raise FileNotFoundError(f"{hf} has neither tokenizer.json nor tokenizer.model")
        say(f"making tokenizer.json from {hf / 'tokenizer.model'} (transformers' TikTokenConverter) ...")
        write_tokenizer_json(hf / "tokenizer.model", folder)
    return folder


# ---- conversions, cached ------------------------------------------------------------------------


def cache_dir(hf: Path) -> Path:
    return hf.parent / f"{hf.name}-gguf"


def gguf_path(cache: Path, fmt: str) -> Path:
    return cache / f"{fmt.lower()}.gguf"


def _fresh(path: Path, sources: list[Path]) -> bool:
    return path.exists() and all(path.stat().st_mtime >= s.stat().st_mtime for s in sources)


def _run_step(cmd: list[str], out: Path, log: Path) -> None:
    """Run one conversion writing ``out``: to a temporary name first, renamed when it succeeded."""
    tmp = out.with_name(out.stem + ".part" + out.suffix)
    cmd = [str(tmp) if c == "{out}" else c for c in cmd]
    try:
        with open(log, "w") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0 or not tmp.exists():
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
            tool = Path(cmd[1] if cmd[0] == sys.executable else cmd[0]).name
            raise RuntimeError(f"{tool} {exit_reason(proc.returncode)} (log {log})"
                               + (f": {tail[-400:]}" if tail else ""))
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)


def ensure_ggufs(tools: Tools, hf: Path, threads: int,
                 say: Callable[[str], None]) -> tuple[dict[str, Path], dict[str, str]]:
    """bf16, Q8_0 and Q4_0 GGUFs of the export, converted once: redone only when older than their source
    (the export's weights and config, or the bf16 GGUF). Returns (path per format, error per format that
    could not be made)."""
    cache = cache_dir(hf)
    cache.mkdir(parents=True, exist_ok=True)
    sources = sorted(hf.glob("*.safetensors")) + [hf / "config.json"]
    bf16 = gguf_path(cache, "bf16")
    paths: dict[str, Path] = {}
    errors: dict[str, str] = {}
    try:
        if not _fresh(bf16, sources):
            folder = converter_input(hf, cache, say)
            say(f"converting {hf} to GGUF bf16 with {tools.convert} (once; minutes for the bench preset) ...")
            start = time.perf_counter()
            _run_step([sys.executable, str(tools.convert), "--outtype", "bf16", "--outfile", "{out}", str(folder)],
                      bf16, cache / "convert.log")
            say(f"wrote {bf16} in {time.perf_counter() - start:.0f} s")
        paths["bf16"] = bf16
    except (OSError, ValueError, RuntimeError) as err:
        return {}, {fmt: f"bf16 conversion: {type(err).__name__}: {err}" for fmt in FORMATS}
    for fmt in FORMATS[1:]:
        path = gguf_path(cache, fmt)
        try:
            if not _fresh(path, [bf16]):
                say(f"quantizing to {fmt} with {tools.quantize} (once) ...")
                start = time.perf_counter()
                _run_step([str(tools.quantize), str(bf16), "{out}", fmt, str(threads)], path,
                          cache / f"quantize-{fmt.lower()}.log")
                say(f"wrote {path} in {time.perf_counter() - start:.0f} s")
            paths[fmt] = path
        except (OSError, RuntimeError) as err:
            errors[fmt] = f"{fmt} quantization: {type(err).__name__}: {err}"
    return paths, errors


# ---- llama-bench --------------------------------------------------------------------------------


def load_flags(tools: Tools) -> list[str]:
    """llama-bench's flag to read the whole model into memory at load, as its --help names it (newer
    builds: ``-lm none``; older: ``-mmp 0``). Memory-mapped, a MoE model's experts would be paged in
    from disk during the timed runs: its warm-up decodes one token, which reads one expert per layer."""
    try:
        text = subprocess.run([str(tools.bench), "--help"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    if "--load-mode" in text:
        return ["-lm", "none"]
    if "--mmap" in text:
        return ["-mmp", "0"]
    return []


def bench_command(tools: Tools, gguf: Path, threads: int, prefill_len: int, decode_tokens: int, runs: int,
                  extra: list[str]) -> list[str]:
    return [str(tools.bench), "-m", str(gguf), "-t", str(threads), "-p", str(prefill_len), "-n", str(decode_tokens),
            "-r", str(runs), *extra, "-o", "json"]


def decode_command(tools: Tools, gguf: Path, threads: int, decode_tokens: int, extra: list[str]) -> list[str]:
    """One llama-bench decode run (no prefill test): the interleaved runs beside llama-lite's."""
    return bench_command(tools, gguf, threads, 0, decode_tokens, 1, extra)


def pair_spec(tools: Tools, ggufs: dict[str, Path], mode: str, spec: dict, extra: list[str]) -> Optional[dict]:
    """What a llama-lite worker of ``mode`` needs to interleave llama.cpp's decode runs with its own
    (``run_pair``), or None when the mode has no paired format or it was not converted."""
    fmt = dict(PAIRS).get(mode)
    if fmt is None or fmt not in ggufs:
        return None
    return {"mode": fmt, "gguf_bytes": ggufs[fmt].stat().st_size,
            "command": decode_command(tools, ggufs[fmt], spec["threads"], spec["decode_tokens"], extra)}


def memory_left_for(pair: dict, rss: int) -> Optional[str]:
    """Why llama.cpp cannot run beside the loaded llama-lite model, whose process holds ``rss`` bytes
    (its GGUF, read whole into memory, and this process would not fit in the machine's memory: pages
    of either would be read again from disk inside the timed runs), or None when it can."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    # llama-bench reads the GGUF whole into its own memory (load_flags), through the page cache, whose
    # once-read pages are the first the kernel takes back
    if rss + pair["gguf_bytes"] + 2 * 1024**3 > total:
        return (f"not interleaved: this model ({rss / 1024**3:.1f} GiB) and llama.cpp's {pair['mode']} "
                f"({pair['gguf_bytes'] / 1024**3:.1f} GiB, read through the page cache) need more than the "
                f"machine's {total / 1024**3:.1f} GiB")
    return None


def run_pair(pair: dict, decode_tokens: int) -> float:
    """One interleaved llama-bench decode run: tokens/s (a RuntimeError / ValueError when it fails)."""
    proc = subprocess.run(pair["command"], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"llama-bench {exit_reason(proc.returncode)}: {tail[-300:]}")
    return parse_bench_json(proc.stdout, 0, decode_tokens, need=("decode_b1_tok_s",))["decode_b1_tok_s"]


def parse_bench_json(text: str, prefill_len: int, decode_tokens: int,
                     need: tuple[str, ...] = ("prefill_tok_s", "decode_b1_tok_s")) -> dict:
    """The result row of one llama-bench ``-o json`` run (a list of tests, each with n_prompt, n_gen,
    avg_ts, stddev_ts, samples_ts, build_commit, build_number, ...): prefill of ``prefill_len`` tokens
    and decode of ``decode_tokens`` tokens after an empty context, tokens/s as the median of the runs."""
    start = text.find("[")
    if start < 0:
        raise ValueError(f"llama-bench printed no JSON list: {text.strip()[:200]!r}")
    tests = json.loads(text[start:])
    row: dict = {}
    for t in tests:
        if prefill_len and t.get("n_prompt") == prefill_len and t.get("n_gen") == 0:
            kind = "prefill"
        elif t.get("n_prompt") == 0 and t.get("n_gen") == decode_tokens:
            kind = "decode_b1"
        else:
            continue
        runs = [float(v) for v in t.get("samples_ts") or []]
        # The median of the runs, as for llama-lite (one run a neighbour slowed moves a mean far more).
        row[f"{kind}_tok_s"] = statistics.median(runs) if runs else float(t["avg_ts"])
        row[f"{kind}_mean"] = float(t["avg_ts"])
        row[f"{kind}_stddev"] = float(t.get("stddev_ts") or 0.0)
        row[f"{kind}_runs"] = runs
        for key in ("build_commit", "build_number", "cpu_info", "model_type", "model_size", "model_n_params",
                    "n_threads"):
            if key in t:
                row[key] = t[key]
    missing = [k for k in need if k not in row]
    if missing:
        raise ValueError(f"llama-bench output has no {' / '.join(missing)} test (pp{prefill_len}, tg{decode_tokens})")
    if "model_size" in row:
        row["gguf_gib"] = row["model_size"] / 1024**3  # weights as llama.cpp stores them
    return row


def exit_reason(returncode: int) -> str:
    """How a tool ended, in words: its exit status, or the signal that killed it, with a hint for
    SIGILL (an instruction the CPU does not execute)."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    why = f"was killed by {name}"
    if -returncode == signal.SIGILL:
        why += (" (an instruction this CPU does not run; on AMX machines llama.cpp's AMX matmul has stopped"
                " so at its first quantized layer: build llama.cpp without AMX, see README)")
    return why


def run_bench(tools: Tools, fmt: str, gguf: Path, spec: dict, extra: list[str]) -> dict:
    """One format through llama-bench; an error row when it fails."""

    cmd = bench_command(tools, gguf, spec["threads"], spec["prefill_len"], spec["decode_tokens"], spec["llama_cpp_runs"],
                        extra)
    row: dict = {"engine": ENGINE, "mode": fmt, "gguf": str(gguf), "command": " ".join(cmd)}
    wait_for_quiet(spec["wait_quiet"])
    load = OtherLoad()
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    share = load.share()
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        row["error"] = f"llama-bench {exit_reason(proc.returncode)}: {tail[-300:]}"
        return row
    try:
        row.update(parse_bench_json(proc.stdout, spec["prefill_len"], spec["decode_tokens"]))
    except (ValueError, KeyError, TypeError) as err:
        row["error"] = f"{type(err).__name__}: {err}"
        return row
    row["bench_s"] = time.perf_counter() - start
    row["others_cpu_pct"] = 100 * share if share is not None else None
    return row


def ratios(results: list[dict]) -> list[dict]:
    """llama-lite over llama.cpp (bf16 / bf16, int4_mixed / Q8_0, int4_all / Q4_0), decode at batch 1 and
    prefill, for the pairs whose both sides ran; ``decode_b1_interleaved``: the median over the
    interleaved runs (``run_pair``) of each llama-lite run over its neighbouring llama.cpp run, with
    their range."""
    lite = {r["mode"]: r for r in results if r["engine"] == "llama-lite" and "error" not in r}
    cpp = {r["mode"]: r for r in results if r["engine"] == ENGINE and "error" not in r}

    def ratio(a: dict, b: dict, key: str) -> Optional[float]:
        return a[key] / b[key] if a.get(key) and b.get(key) else None

    def interleaved(mode: str, fmt: str) -> dict:
        pair = lite.get(mode, {}).get("llama_cpp_pair") or {}
        if pair.get("mode") != fmt or not pair.get("ratios"):
            return {"decode_b1_interleaved": None}
        return {"decode_b1_interleaved": statistics.median(pair["ratios"]),
                "decode_b1_interleaved_range": [min(pair["ratios"]), max(pair["ratios"])],
                "decode_b1_interleaved_runs": len(pair["ratios"])}

    rows = []
    for mode, fmt in PAIRS:
        inter = interleaved(mode, fmt)
        if mode in lite and (fmt in cpp or inter["decode_b1_interleaved"]):
            rows.append({"llama_lite": mode, "llama_cpp": fmt,
                         "decode_b1": ratio(lite[mode], cpp.get(fmt, {}), "decode_b1_tok_s"),
                         "prefill": ratio(lite[mode], cpp.get(fmt, {}), "prefill_tok_s"), **inter})
    return rows


def version(results: list[dict]) -> Optional[dict]:
    """llama.cpp's build as llama-bench reports it (the first row that ran)."""
    row = next((r for r in results if r["engine"] == ENGINE and "build_commit" in r), None)
    return {"build_commit": row["build_commit"], "build_number": row.get("build_number"),
            "cpu_info": row.get("cpu_info")} if row else None


def measure(tools: Tools, ggufs: dict[str, Path], errors: dict[str, str], spec: dict) -> list[dict]:
    """One row per format: llama-bench's figures, or the error that kept it from running."""
    rows = []
    extra = load_flags(tools) if ggufs else []
    for fmt in FORMATS:
        if fmt not in ggufs:
            rows.append({"engine": ENGINE, "mode": fmt, "error": errors.get(fmt, "not converted")})
            continue
        print(f"[benchmark] {ENGINE}-{fmt} ...", file=sys.stderr, flush=True)
        row = run_bench(tools, fmt, ggufs[fmt], spec, extra)
        if "error" in row:
            print(f"[benchmark] {ENGINE}-{fmt} failed: {row['error']}", file=sys.stderr, flush=True)
        else:
            print(f"[benchmark] {ENGINE}-{fmt} done in {row['bench_s']:.0f} s", file=sys.stderr, flush=True)
        rows.append(row)
    return rows
