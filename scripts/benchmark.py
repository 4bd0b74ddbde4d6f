"""Decode and prefill speed, memory and memory-roofline of llama-lite in bf16 and every quantization
mode, with Meta's llama-models reference and Hugging Face transformers as peers, in one run.

    python -m scripts.benchmark [--preset bench] [--checkpoint DIR] [--modes bf16,int4_mixed,fp8_mixed,w4a8,nvfp4,int4_all]
                                [--peers] [--llama_cpp BUILD_DIR] [--quick] [--out results.json] [--plot bench.png]
                                [--compile/--nocompile]

Without --checkpoint a synthetic checkpoint of --preset is written once under ~/.cache/llama-lite/
(the bench preset: ~4.6B parameters, ~9 GB, a few minutes) and reused; --peers also writes its
Hugging Face export (same weights). Each engine and mode runs in its own process, one after the
other, so memory holds one model at a time and every process has its own peak RSS.

What is measured, per engine / mode:
* decode tokens/s at batch 1 and batch 8 (a warm-up run, then the median of several runs of
  ``generate``; batch 8 counts the tokens of all rows), prefill tokens/s of one --prefill_len-token
  prompt, time to first token of that prompt, load time, and peak RSS while loading and while
  running, measured separately (VmHWM, reset in between; anonymous memory sampled apart from
  file-backed pages, since bf16 weights are memory-mapped from the checkpoint).
* the memory roofline: bytes of weights one decoded token reads (attention, shared expert, the
  top-k routed experts of each MoE layer, dense FFN, output layer, one embedding row; bytes as
  each format stores them) divided by the time a plain streaming read of as many bytes takes.
  Streaming reads are taken right before and after every decode run, so "% of roofline" compares
  the two under the same load of the (shared, noisy) machine.
* peers (--peers): llama-models' ``Transformer`` (bf16, on the CPU) and transformers'
  ``Llama4ForCausalLM`` (bf16, sdpa), decode tokens/s at batch 1 and the ratio to llama-lite bf16.
* llama.cpp (--llama_cpp BUILD_DIR, see scripts/bench_llama_cpp.py): the Hugging Face export converted
  once to GGUF bf16, Q8_0 and Q4_0, each run by llama-bench with the same threads, decode length
  (``-n``) and prefill length (``-p``); a second table gives llama-lite bf16 / llama.cpp bf16,
  int4_mixed / Q8_0 and int4_all / Q4_0 (and the _a8 modes against the same). Without the flag there are no llama.cpp rows.

Output: a markdown table on stdout, --out (JSON) and --plot (PNG bar chart, needs matplotlib:
``pip install -e ".[bench]"``; skipped with a note without it).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from scripts import bench_llama_cpp
from scripts.common import FlagError, run_cli, text_flag
from scripts.machine_load import OtherLoad, wait_for_quiet

ROOT = Path(__file__).resolve().parent.parent
MODES = ("bf16", "int4_mixed", "fp8_mixed", "w4a8", "nvfp4", "int4_all", "int4_mixed_a8", "int4_all_a8")
# benchmark mode -> (quantization mode, targets, int8 activations)
BUILDS = {"bf16": ("none", None, False), "int4_all": ("int4_mixed", "all", False),
          "int4_mixed_a8": ("int4_mixed", None, True), "int4_all_a8": ("int4_mixed", "all", True)}
PEERS = ("llama-models", "transformers")
GiB = 1024**3

# Runs per measurement. The machine is shared: medians of several runs, and ratios taken within a run.
FULL = dict(preset="bench", decode_tokens=24, decode_runs=5, batch=8, batch_tokens=12, batch_runs=3,
            prompt_len=16, prefill_len=512, prefill_runs=3, peer_tokens=8, peer_runs=3, llama_cpp_runs=5)
QUICK = dict(preset="tiny", decode_tokens=6, decode_runs=2, batch=8, batch_tokens=4, batch_runs=1,
             prompt_len=8, prefill_len=64, prefill_runs=1, peer_tokens=4, peer_runs=1, llama_cpp_runs=1)



# ---- measuring ------------------------------------------------------------------------------------


class MemoryMonitor:
    """Peak resident memory of this process over a phase: VmHWM (all pages), and sampled peaks of
    anonymous and file-backed pages (memory-mapped weights are file pages: page cache the kernel
    can drop, unlike anonymous memory)."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @staticmethod
    def status() -> dict[str, int]:
        out = {}
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                        out[key] = int(value.split()[0]) * 1024
        except OSError:
            import resource

            out["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return out

    def start(self) -> "MemoryMonitor":
        try:  # reset VmHWM, so each phase has its own peak (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self.peak = {}
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        for key, value in self.status().items():
            self.peak[key] = max(self.peak.get(key, 0), value)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        return {
            "peak_rss_gib": self.peak.get("VmHWM", 0) / GiB,
            "peak_anon_gib": self.peak.get("RssAnon", 0) / GiB,
            "peak_file_gib": self.peak.get("RssFile", 0) / GiB,
        }


class StreamRead:
    """A plain streaming read (a sum over a buffer larger than any cache) timed as GB/s: the
    machine's memory bandwidth right now, as one thread pool of this process can pull it. The
    buffer is in 2 MiB pages, as the quantized loader places weights (kernels.memory)."""

    def __init__(self, nbytes: int, buffer_bytes: int = 512 * 1024**2):
        from kernels.memory import huge_page_copy

        size = max(64 * 1024**2, min(buffer_bytes, nbytes))
        self.buf = huge_page_copy(torch.ones(size // 4, dtype=torch.float32))
        self.passes = max(1, round(nbytes / size))
        self.buf.sum()  # fault the pages in

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * 4

    def bandwidth(self) -> float:
        start = time.perf_counter()
        for _ in range(self.passes):
            self.buf.sum()
        return self.passes * self.nbytes / (time.perf_counter() - start)


def _quiet(run: dict) -> bool:
    return run["others"] is None or run["others"] < 0.15


def median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 190000, (n, length), generator=g).tolist()  # ordinary (non-special) tokens


def timed_generate(llama, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float]]:
    """(start time, time of each generation step) of a greedy ``generate``."""
    stamps = []
    start = time.perf_counter()
    for _ in llama.generate(prompts, temperature=0, max_gen_len=new_tokens, stop_tokens=[]):
        stamps.append(time.perf_counter())
    return start, stamps


# ---- what a decoded token reads -----------------------------------------------------------------


def _stored_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors ``module`` itself holds (not its children): parameters, buffers and the tensors
    of quantized weight containers, as stored (prepared fast-path caches excluded)."""
    from dataclasses import fields, is_dataclass

    out = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    for value in vars(module).values():
        if is_dataclass(value) and not isinstance(value, type):
            out += [getattr(value, f.name) for f in fields(value) if isinstance(getattr(value, f.name), torch.Tensor)]
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every stored weight (each storage once)."""
    seen, total = set(), 0
    for module in model.modules():
        for t in _stored_tensors(module):
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


def kv_cache_bytes(model: torch.nn.Module) -> int:
    return sum(_nbytes(layer.attention.cache_k) + _nbytes(layer.attention.cache_v)
               for layer in model.layers if layer.attention.cache_k is not None)


def bytes_per_token(model: torch.nn.Module, top_k: int) -> dict[str, int]:
    """Weight bytes one decoded token (batch 1) reads, by part: every weight of a layer, except
    routed experts (top_k of E) and the embedding table (one row)."""
    from llama_lite.model import Experts, FeedForward, MoE

    parts: dict[str, int] = {}

    def add(part: str, module: torch.nn.Module, fraction: float = 1.0) -> None:
        n = sum(_nbytes(t) for m in module.modules() for t in _stored_tensors(m))
        parts[part] = parts.get(part, 0) + int(n * fraction)

    add("embedding row", model.tok_embeddings, 1 / model.vocab_size)
    for layer in model.layers:
        add("attention", layer.attention)
        add("norms", layer.attention_norm)
        add("norms", layer.ffn_norm)
        ff = layer.feed_forward
        if isinstance(ff, MoE):
            experts = ff.experts
            n_experts = experts.num_experts if isinstance(experts, Experts) else getattr(experts, "num_experts")
            add("routed experts", experts, top_k / n_experts)
            add("shared expert", ff.shared_expert)
            parts["router"] = parts.get("router", 0) + _nbytes(ff.router_DE)
        else:
            assert isinstance(ff, FeedForward) or hasattr(ff, "w1")
            add("dense ffn", ff)
    add("norms", model.norm)
    add("output", model.output)
    return parts


# ---- workers: one process per engine and mode ---------------------------------------------------


def _build_llama_lite(spec: dict):
    """The model as the scripts build it (``quantization.build``; bf16 is mode ``none``)."""
    import quantization

    build_kwargs = dict(max_seq_len=spec["max_seq_len"], max_batch_size=spec["batch"], compile=spec["compile"])
    mode, targets, int8 = BUILDS.get(spec["mode"], (spec["mode"], None, False))
    return quantization.build(spec["checkpoint"], mode, targets=targets, int8_activations=int8, progress=False,
                              **build_kwargs)


def run_llama_lite(spec: dict) -> dict:
    from llama_lite.distributed import init_distributed

    init_distributed(1, "cpu")
    mem = MemoryMonitor().start()
    start = time.perf_counter()
    llama = _build_llama_lite(spec)
    res: dict[str, Any] = {"load_s": time.perf_counter() - start}
    res.update({f"load_{k}": v for k, v in mem.stop().items()})
    model = llama.model
    top_k = llama.args.moe_args.top_k if llama.args.moe_args else 1
    parts = bytes_per_token(model, top_k)
    res["bytes_per_token"] = sum(parts.values())
    res["bytes_per_token_parts"] = parts
    res["weights_gib"] = weight_bytes(model) / GiB
    res["kv_cache_gib"] = kv_cache_bytes(model) / GiB
    stream = StreamRead(res["bytes_per_token"])
    res["stream_buffer_gib"] = stream.nbytes / GiB

    mem.start()
    # Warm-up: pages of memory-mapped weights, kernel caches, compiled graphs.
    timed_generate(llama, random_prompts(1, spec["prompt_len"], 0), 3)
    timed_generate(llama, random_prompts(spec["batch"], spec["prompt_len"], 1), 3)

    quiet = spec["wait_quiet"]
    pair = spec.get("llama_cpp_pair")
    pair_note = bench_llama_cpp.memory_left_for(pair, MemoryMonitor.status().get("VmRSS", 0)) if pair else None
    if pair_note:
        print(f"[benchmark] llama.cpp {pair['mode']} {pair_note}", file=sys.stderr, flush=True)
        pair = None
    runs: list[dict] = []  # per decode run: tok/s, bandwidth, others' CPU share (, llama.cpp's neighbouring run)
    for r in range(2 * spec["decode_runs"] if quiet else spec["decode_runs"]):
        wait_for_quiet(quiet)
        load = OtherLoad()
        bw_before = stream.bandwidth()
        _, stamps = timed_generate(llama, random_prompts(1, spec["prompt_len"], 10 + r), spec["decode_tokens"])
        bw = (bw_before + stream.bandwidth()) / 2
        runs.append({"tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]), "bw": bw, "others": load.share()})
        if pair:
            try:
                runs[-1]["peer_tok_s"] = bench_llama_cpp.run_pair(pair, spec["decode_tokens"])
            except (RuntimeError, ValueError, KeyError, TypeError, OSError) as err:
                pair_note = f"interleaved run failed: {type(err).__name__}: {err}"
                print(f"[benchmark] llama.cpp {pair['mode']} {pair_note}", file=sys.stderr, flush=True)
                pair = None
            runs[-1]["others"] = max((s for s in (runs[-1]["others"], load.share()) if s is not None), default=None)
        if sum(_quiet(run) for run in runs) >= spec["decode_runs"]:
            break
    # With --wait_quiet, runs that neighbours disturbed (> 15% of the CPUs) are left out when enough others are not.
    kept = [run for run in runs if _quiet(run)] if quiet else runs
    kept = kept if len(kept) >= max(1, spec["decode_runs"] // 2) else runs
    res["decode_b1_tok_s"] = median([run["tok_s"] for run in kept])
    res["decode_b1_runs"] = [run["tok_s"] for run in runs]
    res["decode_b1_runs_kept"] = len(kept)
    res["stream_gb_s"] = median([run["bw"] for run in kept]) / 1e9
    res["roofline_tok_s"] = median([run["bw"] for run in kept]) / res["bytes_per_token"]
    res["roofline_pct"] = 100 * median([run["tok_s"] * res["bytes_per_token"] / run["bw"] for run in kept])
    others = [run["others"] for run in kept]
    res["others_cpu_pct"] = 100 * median(others) if None not in others else None
    if spec.get("llama_cpp_pair"):
        paired = [run for run in kept if run.get("peer_tok_s")]
        res["llama_cpp_pair"] = {"mode": spec["llama_cpp_pair"]["mode"],
                                 "command": " ".join(spec["llama_cpp_pair"]["command"]),
                                 "lite_tok_s": [run["tok_s"] for run in paired],
                                 "peer_tok_s": [run["peer_tok_s"] for run in paired],
                                 "ratios": [run["tok_s"] / run["peer_tok_s"] for run in paired]}
        if pair_note:
            res["llama_cpp_pair"]["note"] = pair_note

    b8 = []
    for r in range(spec["batch_runs"]):
        wait_for_quiet(quiet)
        _, stamps = timed_generate(llama, random_prompts(spec["batch"], spec["prompt_len"], 20 + r),
                                   spec["batch_tokens"])
        b8.append(spec["batch"] * (len(stamps) - 1) / (stamps[-1] - stamps[0]))
    res["decode_b8_tok_s"] = median(b8)

    prompt = random_prompts(1, spec["prefill_len"], 30)
    tokens = torch.tensor(prompt)
    last = torch.tensor([spec["prefill_len"] - 1])
    prefill, ttft = [], []
    model(tokens, 0, last_index=last)  # warm-up at this length
    for _ in range(spec["prefill_runs"]):
        wait_for_quiet(quiet)
        t0 = time.perf_counter()
        model(tokens, 0, last_index=last)
        prefill.append(spec["prefill_len"] / (time.perf_counter() - t0))
        t0, stamps = timed_generate(llama, prompt, 1)
        ttft.append(stamps[0] - t0)
    res["prefill_tok_s"] = median(prefill)
    res["ttft_s"] = median(ttft)
    res.update({f"run_{k}": v for k, v in mem.stop().items()})
    return res


def _step_loop(step: Callable[[torch.Tensor, int], torch.Tensor], prompt: torch.Tensor, new_tokens: int) -> list[float]:
    """Greedy decoding through ``step(tokens, start_pos) -> logits``; the time of each step."""
    logits = step(prompt, 0)
    stamps = [time.perf_counter()]
    pos = prompt.shape[1]
    for _ in range(new_tokens - 1):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        logits = step(nxt, pos)
        pos += 1
        stamps.append(time.perf_counter())
    return stamps


def _peer_decode(step, spec: dict) -> dict:
    _step_loop(step, torch.tensor(random_prompts(1, spec["prompt_len"], 0)), 3)  # warm-up
    quiet = spec["wait_quiet"]
    runs: list[dict] = []
    for r in range(2 * spec["peer_runs"] if quiet else spec["peer_runs"]):
        wait_for_quiet(quiet)
        load = OtherLoad()
        stamps = _step_loop(step, torch.tensor(random_prompts(1, spec["prompt_len"], 10 + r)), spec["peer_tokens"])
        runs.append({"tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]), "others": load.share()})
        if sum(_quiet(run) for run in runs) >= spec["peer_runs"]:
            break
    kept = [run for run in runs if _quiet(run)] if quiet else runs
    kept = kept if len(kept) >= max(1, spec["peer_runs"] // 2) else runs
    others = [run["others"] for run in kept]
    return {"decode_b1_tok_s": median([run["tok_s"] for run in kept]), "decode_b1_runs": [run["tok_s"] for run in runs],
            "decode_b1_runs_kept": len(kept), "others_cpu_pct": 100 * median(others) if None not in others else None}


def run_llama_models(spec: dict) -> dict:
    """Meta's reference on the CPU: its KV cache calls .cuda(), made a no-op here. It casts
    activations to fp32 with attention temperature tuning on, so that runs off (no effect on the
    numbers below 8192 positions with the synthetic presets' floor scale)."""
    from llama_models.llama4.args import ModelArgs as RefArgs
    from llama_models.llama4.datatypes import TransformerInput
    from llama_models.llama4.model import Transformer as RefTransformer

    from llama_lite.distributed import init_distributed

    init_distributed(1, "cpu")
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    ckpt = Path(spec["checkpoint"])
    params = json.loads((ckpt / "params.json").read_text())
    params["attn_temperature_tuning"] = False
    mem = MemoryMonitor().start()
    start = time.perf_counter()
    args = RefArgs(**params, max_seq_len=spec["max_seq_len"], max_batch_size=1)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        ref = RefTransformer(args)
    finally:
        torch.set_default_dtype(default)
    shards = sorted(ckpt.glob("consolidated.*.pth"))
    if len(shards) != 1:
        raise ValueError(f"the llama-models peer runs one shard; {ckpt} has {len(shards)}")
    state = torch.load(shards[0], map_location="cpu", mmap=True, weights_only=True)
    ref.load_state_dict(state, strict=False)
    del state
    ref.eval()
    res: dict[str, Any] = {"load_s": time.perf_counter() - start}
    res.update({f"load_{k}": v for k, v in mem.stop().items()})

    def step(tokens: torch.Tensor, pos: int) -> torch.Tensor:
        return ref(TransformerInput(tokens=tokens, tokens_position=pos)).logits

    mem.start()
    with torch.inference_mode():
        res.update(_peer_decode(step, spec))
    res.update({f"run_{k}": v for k, v in mem.stop().items()})
    return res


def run_transformers(spec: dict) -> dict:
    from scripts.common import allow_cpu_torchvision

    allow_cpu_torchvision()
    from transformers import Llama4ForCausalLM

    mem = MemoryMonitor().start()
    start = time.perf_counter()
    model = Llama4ForCausalLM.from_pretrained(spec["hf_checkpoint"], dtype=torch.bfloat16,
                                              attn_implementation="sdpa").eval()
    res: dict[str, Any] = {"load_s": time.perf_counter() - start}
    res.update({f"load_{k}": v for k, v in mem.stop().items()})
    state: dict[str, Any] = {}

    def step(tokens: torch.Tensor, pos: int) -> torch.Tensor:
        if pos == 0:
            state["past"] = None
        out = model(input_ids=tokens, past_key_values=state["past"], use_cache=True)
        state["past"] = out.past_key_values
        return out.logits

    mem.start()
    with torch.inference_mode():
        res.update(_peer_decode(step, spec))
    res.update({f"run_{k}": v for k, v in mem.stop().items()})
    return res


RUNNERS = {"llama-lite": run_llama_lite, "llama-models": run_llama_models, "transformers": run_transformers}


def worker_main(spec_path: str) -> None:
    """Entry point of a worker process: run one engine / mode as ``spec_path`` describes, write JSON."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    result: dict[str, Any] = {"engine": spec["engine"], "mode": spec["mode"]}
    try:
        result.update(RUNNERS[spec["engine"]](spec))
    except Exception as err:  # noqa: BLE001 -- reported in the table, the other runs go on
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(err).__name__}: {err}"
    Path(spec["result"]).write_text(json.dumps(result))


def run_worker(spec: dict, workdir: Path) -> dict:
    """Run one engine / mode in a fresh process (its own memory peak; one model in memory at a time)."""
    tag = f"{spec['engine']}-{spec['mode']}"
    spec = {**spec, "result": str(workdir / f"{tag}.result.json")}
    spec_path = workdir / f"{tag}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    code = f"from scripts.benchmark import worker_main; worker_main({str(spec_path)!r})"
    print(f"[benchmark] {tag} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    result_path = Path(spec["result"])
    if result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        result = {"engine": spec["engine"], "mode": spec["mode"],
                  "error": f"worker exited with status {proc.returncode}: {proc.stderr.strip()[-400:]}"}
    if "error" in result:
        print(f"[benchmark] {tag} failed: {result['error']}\n{proc.stderr[-2000:]}", file=sys.stderr, flush=True)
    else:
        print(f"[benchmark] {tag} done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return result


# ---- reporting ----------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _ratio(value: Optional[float]) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def normalized_vs(r: dict, base: Optional[dict]) -> Optional[float]:
    """Decode speed relative to ``base`` per GB/s of the streaming read measured in each one's own
    runs: modes measured minutes apart on a shared machine meet different memory bandwidth, and
    this ratio takes that out (peers have no streaming read: None)."""
    if not base or not r.get("stream_gb_s") or not base.get("stream_gb_s") or not r.get("decode_b1_tok_s"):
        return None
    return (r["decode_b1_tok_s"] / r["stream_gb_s"]) / (base["decode_b1_tok_s"] / base["stream_gb_s"])


def markdown_table(results: list[dict]) -> str:
    bf16 = next((r for r in results if r["engine"] == "llama-lite" and r["mode"] == "bf16" and "error" not in r), None)
    base = bf16.get("decode_b1_tok_s") if bf16 else None
    head = ["engine", "mode", "decode b1 tok/s", "decode b8 tok/s", "prefill tok/s", "TTFT s", "GB/token",
            "roofline tok/s", "% roofline", "others' CPU %", "vs lite bf16 (per GB/s)", "load s", "load peak RSS GiB (anon)",
            "run peak RSS GiB (anon)", "weights + KV GiB"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['engine']} | {r['mode']} | error: {r['error'][:120]} |" + " |" * (len(head) - 3))
            continue
        vs = r["decode_b1_tok_s"] / base if base and r.get("decode_b1_tok_s") else None
        norm = normalized_vs(r, bf16)
        weights = r.get("weights_gib")
        mem_need = weights + r["kv_cache_gib"] if weights is not None else None
        run_rss = r.get("run_peak_rss_gib")
        run_anon = r.get("run_peak_anon_gib")
        if run_rss is not None and r.get("stream_buffer_gib"):  # the benchmark's own read buffer is not the engine's
            run_rss -= r["stream_buffer_gib"]
            run_anon -= r["stream_buffer_gib"]
        cells = [
            r["engine"], r["mode"], _fmt(r.get("decode_b1_tok_s")), _fmt(r.get("decode_b8_tok_s")),
            _fmt(r.get("prefill_tok_s"), 1), _fmt(r.get("ttft_s")),
            _fmt(r["bytes_per_token"] / 1e9 if r.get("bytes_per_token") else None, 3),
            _fmt(r.get("roofline_tok_s")), _fmt(r.get("roofline_pct"), 0), _fmt(r.get("others_cpu_pct"), 0),
            (_fmt(vs) + "x" if vs else "-") + (f" ({_fmt(norm)}x)" if norm else ""),
            _fmt(r.get("load_s"), 1),
            f"{_fmt(r.get('load_peak_rss_gib'))} ({_fmt(r.get('load_peak_anon_gib'))})",
            f"{_fmt(run_rss)} ({_fmt(run_anon)})" if run_rss is not None else "-",
            _fmt(mem_need),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def llama_cpp_notes(tools, ratios: list[dict], version: Optional[dict], settings: dict) -> str:
    """The llama.cpp build and command under the table, and llama-lite's speed over llama.cpp's."""
    build = f"build {version['build_commit']} ({version['build_number']})" if version else "no build ran"
    lines = [f"llama.cpp: {build}, {tools.bench} -t {settings['threads']} -p {settings['prefill_len']} "
             f"-n {settings['decode_tokens']} -r {settings['llama_cpp_runs']} (median of the runs; decode after an empty "
             "context). Q8_0 / Q4_0 by llama-quantize's default recipe (its Q4_0 keeps output.weight in Q6_K; with 8 "
             "experts, attention K/V in Q8_0).\n"]
    if ratios:
        lines += ["| llama-lite | llama.cpp | decode b1 lite / llama.cpp, interleaved runs: median (range, pairs) "
                  "| decode b1, separate runs | prefill lite / llama.cpp |", "|---|---|---|---|---|"]
        for r in ratios:
            inter = "-"
            if r.get("decode_b1_interleaved"):
                lo, hi = r["decode_b1_interleaved_range"]
                inter = f"{_ratio(r['decode_b1_interleaved'])} ({lo:.2f}-{hi:.2f}, {r['decode_b1_interleaved_runs']})"
            lines.append(f"| {r['llama_lite']} | {r['llama_cpp']} | {inter} | {_ratio(r['decode_b1'])} | "
                         f"{_ratio(r['prefill'])} |")
        lines += ["", "Interleaved: each llama-lite decode run is followed by one llama-bench decode run "
                  f"(-p 0 -n {settings['decode_tokens']} -r 1) while the llama-lite model stays loaded, and the "
                  "ratio is taken per neighbouring pair: the machine's memory bandwidth can drift by 2x between "
                  "runs minutes apart (the separate runs), much less between neighbours.", ""]
    return "\n".join(lines)


# decode % of roofline each quantized mode should reach (bf16: 85)
ROOFLINE_GOALS = {"int4_mixed": 60, "int4_all": 70}
# llama-lite mode -> (decode b1, prefill) speed over its llama.cpp pair it should reach (None: no goal)
LLAMA_CPP_GOALS = {"bf16": (1.0, 2.0), "int4_mixed": (1.0, None), "int4_all": (1.3, 1.5)}


def check_targets(results: list[dict], preset: str) -> list[dict]:
    """The performance targets, each met or missed with its numbers."""
    lite = {r["mode"]: r for r in results if r["engine"] == "llama-lite" and "error" not in r}
    peers = {r["engine"]: r for r in results if r["engine"] in PEERS and "error" not in r}
    out = []

    def target(name: str, value: Optional[float], goal: float, unit: str = "", at_most: bool = False) -> None:
        if value is not None:
            met = value <= goal if at_most else value >= goal
            out.append({"target": name, "value": value, "goal": goal, "met": met, "unit": unit, "at_most": at_most})

    bf16 = lite.get("bf16")
    if bf16:
        target("bf16 decode % of roofline", bf16.get("roofline_pct"), 85, "%")
        for name, peer in peers.items():
            target(f"bf16 decode vs {name}", bf16["decode_b1_tok_s"] / peer["decode_b1_tok_s"], 3, "x")
    for mode, r in lite.items():
        if mode == "bf16":
            continue
        target(f"{mode} decode % of roofline", r.get("roofline_pct"), ROOFLINE_GOALS.get(mode, 50), "%")
        if bf16:  # per GB/s of streaming read (see normalized_vs); the raw ratio is in the table
            target(f"{mode} decode vs bf16, per GB/s", normalized_vs(r, bf16), 1.0, "x")
    # against llama.cpp on the same weights (--llama_cpp): decode at batch 1 by the median of the
    # interleaved runs where they ran (the separate runs measure the machine's drift as well)
    for r in bench_llama_cpp.ratios(results):
        decode, prefill = LLAMA_CPP_GOALS.get(r["llama_lite"], (None, None))
        pair = f"{r['llama_lite']} vs llama.cpp {r['llama_cpp']}"
        inter = r.get("decode_b1_interleaved")
        if decode is not None:
            target(f"{pair}: decode b1, {'interleaved' if inter else 'separate runs'}", inter or r["decode_b1"],
                   decode, "x")
        if prefill is not None:
            target(f"{pair}: prefill", r["prefill"], prefill, "x")
    int4 = lite.get("int4_mixed")
    if int4 and int4.get("load_peak_rss_gib") and int4.get("weights_gib") is not None:
        need = int4["weights_gib"] + int4.get("kv_cache_gib", 0)
        target("int4_mixed load peak RSS / (weights + KV cache)", int4["load_peak_rss_gib"] / need, 1.25, "x",
               at_most=True)
    return out


def plot_results(results: list[dict], path: Path) -> Optional[str]:
    """Bar chart of decode tokens/s (batch 1 and 8) per engine and mode, roofline as a marker line.
    Returns a note when it cannot be drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e \".[bench]\"); no plot written"
    ok = [r for r in results if "error" not in r]
    if not ok:
        return "nothing to plot"
    labels = [r["mode"] if r["engine"] == "llama-lite" else r["engine"] if r["engine"] in PEERS
              else f"{r['engine']} {r['mode']}" for r in ok]
    x = range(len(ok))
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(ok)), 4.5))
    b1 = [r.get("decode_b1_tok_s") or 0 for r in ok]
    b8 = [r.get("decode_b8_tok_s") or 0 for r in ok]
    ax.bar([i - 0.2 for i in x], b1, width=0.4, label="decode, batch 1")
    ax.bar([i + 0.2 for i in x], b8, width=0.4, label="decode, batch 8 (all rows)")
    roof = [(i, r["roofline_tok_s"]) for i, r in zip(x, ok) if r.get("roofline_tok_s")]
    if roof:
        ax.hlines([v for _, v in roof], [i - 0.45 for i, _ in roof], [i + 0.05 for i, _ in roof], colors="black",
                  linestyles="dashed", label="memory roofline, batch 1")
    for i, r in zip(x, ok):
        if r.get("roofline_pct"):
            ax.annotate(f"{r['roofline_pct']:.0f}%", (i - 0.2, b1[i]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, rotation=20)
    ax.set_ylabel("tokens / s")
    ax.set_title("llama-lite decode speed (llama-lite modes, then peers)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ---- the command --------------------------------------------------------------------------------


def cache_root(cache_dir: Optional[str]) -> Path:
    return Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "llama-lite"


def ensure_checkpoint(root: Path, preset: str, fmt: str) -> Path:
    """The synthetic checkpoint of ``preset`` (seed 0) in ``fmt``, written once and reused."""
    from llama_lite.synthetic import checkpoint_bytes, preset_args, write_random_checkpoint

    path = root / f"{preset}-{fmt}-seed0"
    marker = "params.json" if fmt == "meta" else "config.json"
    if not (path / marker).exists():
        size = checkpoint_bytes(preset_args(preset)) / 1e9
        print(f"[benchmark] writing the {preset} checkpoint ({fmt}, {size:.1f} GB) to {path} once ...",
              file=sys.stderr, flush=True)
        write_random_checkpoint(path, preset=preset, seed=0, fmt=fmt)
    return path


def machine_info(threads: int) -> dict:
    info = {"platform": platform.platform(), "torch": torch.__version__, "threads": threads,
            "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    from kernels import cpu

    info["cpu_paths"] = list(cpu.cpu_isas())
    info["cpu_path_in_force"] = cpu.isa()  # LLAMA_LITE_CPU_ISA, as every mode's process sees it
    info["onednn_max_isa"] = cpu.onednn_cap() or "(the best this CPU has)"  # capped with it, set at start
    return info


def main(
    preset: Optional[str] = None,
    checkpoint: Optional[str] = None,
    modes: str = ",".join(MODES),
    peers: bool = False,
    quick: bool = False,
    out: str = "results.json",
    plot: Optional[str] = "bench.png",
    compile: bool = False,  # noqa: A002 - the flag is --compile
    threads: int = 2,
    hf_checkpoint: Optional[str] = None,
    cache_dir: Optional[str] = None,
    wait_quiet: float = 120.0,
    llama_cpp: Optional[str] = None,
) -> None:
    """Benchmark llama-lite decode / prefill / memory in bf16 and each quantization mode, against its roofline and peers.

    Args:
        preset: Synthetic checkpoint preset to write and use when no --checkpoint is given (default bench; tiny with --quick).
        checkpoint: A bf16 checkpoint folder (Meta or Hugging Face layout) to use instead.
        modes: Comma-separated: bf16, int4_mixed, fp8_mixed, w4a8, nvfp4, int4_all (int4 of attention, experts, shared expert and output),
            int4_mixed_a8 and int4_all_a8 (the same with int8 activations, quantization.build(int8_activations=True)).
        peers: Also run llama-models' reference and transformers' Llama4ForCausalLM (bf16 decode at batch 1).
        quick: Tiny preset, a few tokens: a smoke test that takes seconds.
        out: Where to write the results as JSON.
        plot: Where to write the PNG bar chart ("" for none).
        compile: Build llama-lite with torch.compile'd decode pieces.
        threads: CPU threads for every engine.
        hf_checkpoint: Hugging Face layout of the same weights, for the transformers peer (written from the preset when not given).
        cache_dir: Where synthetic checkpoints are kept (default ~/.cache/llama-lite).
        wait_quiet: Before each timed run, wait up to this many seconds for other processes to leave the
            CPUs (< 15% of their time); 0 never waits. "others' CPU %" in the table says how quiet it was.
        llama_cpp: A llama.cpp build folder (bin/llama-bench, bin/llama-quantize) inside its source
            (convert_hf_to_gguf.py); also convert the Hugging Face export to GGUF bf16 / Q8_0 / Q4_0 once
            (cached beside it) and run llama-bench on each with the same threads and lengths.
    """
    modes_text = text_flag("modes", modes) or ""
    chosen = [m.strip() for m in modes_text.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in MODES]
    if unknown:
        raise FlagError(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise FlagError(f"--threads must be a positive integer, got {threads!r}")
    if not isinstance(wait_quiet, (int, float)) or isinstance(wait_quiet, bool) or wait_quiet < 0:
        raise FlagError(f"--wait_quiet must be a number of seconds >= 0, got {wait_quiet!r}")
    tools = bench_llama_cpp.find_tools(text_flag("llama_cpp", llama_cpp) or "") if llama_cpp is not None else None
    settings = dict(QUICK if quick else FULL)
    preset = text_flag("preset", preset) or settings["preset"]
    root = cache_root(text_flag("cache_dir", cache_dir))
    if checkpoint:
        ckpt = Path(text_flag("checkpoint", checkpoint)).expanduser()
        if not ckpt.is_dir():
            raise FlagError(f"--checkpoint {ckpt} is not a folder")
        preset = "custom"
    else:
        from llama_lite.synthetic import PRESETS

        if preset not in PRESETS:
            raise FlagError(f"unknown --preset {preset!r}; choose one of {', '.join(PRESETS)}")
        ckpt = ensure_checkpoint(root, preset, "meta")
    hf = Path(text_flag("hf_checkpoint", hf_checkpoint)).expanduser() if hf_checkpoint else None
    if (peers or tools) and hf is None:
        if (ckpt / "config.json").exists():
            hf = ckpt
        elif preset != "custom":
            hf = ensure_checkpoint(root, preset, "hf")

    settings.update(checkpoint=str(ckpt), hf_checkpoint=str(hf) if hf else None, threads=threads,
                    compile=bool(compile), preset=preset, wait_quiet=0.0 if quick else float(wait_quiet))
    settings["max_seq_len"] = max(settings["prefill_len"], settings["prompt_len"]) + max(
        settings["decode_tokens"], settings["batch_tokens"], settings["peer_tokens"]) + 8
    info = machine_info(threads)
    ggufs: dict[str, Path] = {}
    gguf_errors: dict[str, str] = {}
    if tools:  # converted before anything is timed (once; then from the cache)
        if hf is None or not (hf / "config.json").exists():
            gguf_errors = dict.fromkeys(bench_llama_cpp.FORMATS, "needs --hf_checkpoint (the same weights in "
                                        "Hugging Face layout)")
        else:
            differs = bench_llama_cpp.differences(json.loads((hf / "config.json").read_text()))
            if differs:
                print(f"[benchmark] note: llama.cpp fixes what this checkpoint sets otherwise: {'; '.join(differs)}",
                      file=sys.stderr, flush=True)
            settings["llama_cpp_differs"] = differs
            ggufs, gguf_errors = bench_llama_cpp.ensure_ggufs(
                tools, hf, threads, lambda m: print(f"[benchmark] llama.cpp: {m}", file=sys.stderr, flush=True))
            for fmt, err in gguf_errors.items():
                print(f"[benchmark] llama.cpp {fmt} not made: {err}", file=sys.stderr, flush=True)
    results = []
    pair_flags = bench_llama_cpp.load_flags(tools) if ggufs else []
    with tempfile.TemporaryDirectory(prefix="llama-lite-bench-") as tmp:
        for mode in chosen:
            pair = bench_llama_cpp.pair_spec(tools, ggufs, mode, settings, pair_flags) if ggufs else None
            results.append(run_worker({**settings, "engine": "llama-lite", "mode": mode, "llama_cpp_pair": pair},
                                      Path(tmp)))
        if peers:
            if (ckpt / "params.json").exists():
                results.append(run_worker({**settings, "engine": "llama-models", "mode": "bf16"}, Path(tmp)))
            else:
                results.append({"engine": "llama-models", "mode": "bf16",
                                "error": "needs a Meta-layout checkpoint (params.json + consolidated.NN.pth)"})
            if hf is not None:
                results.append(run_worker({**settings, "engine": "transformers", "mode": "bf16"}, Path(tmp)))
            else:
                results.append({"engine": "transformers", "mode": "bf16",
                                "error": "needs --hf_checkpoint (the same weights in Hugging Face layout)"})
    if tools:
        results += bench_llama_cpp.measure(tools, ggufs, gguf_errors, settings)
    info["load_avg_end"] = os.getloadavg()
    targets = check_targets(results, preset)

    print(f"\n## llama-lite benchmark: {preset} ({ckpt}), {threads} threads, compile={bool(compile)}\n")
    print(markdown_table(results))
    print("\nRoofline: weight bytes per decoded token / bandwidth of a plain streaming read measured around each "
          "decode run. RSS in GiB (anonymous memory in parentheses; bf16 weights are memory-mapped file pages); "
          "run RSS excludes the benchmark's read buffer. \"vs lite bf16\": decode tokens/s over bf16's, and in "
          "parentheses the same per GB/s of streaming read measured in each one's own runs (modes run minutes apart, "
          "and the machine's bandwidth drifts in between).")
    print(f"Load average {info['load_avg_start'][0]:.1f} at the start, {info['load_avg_end'][0]:.1f} at the end "
          f"({info['cpus']} CPUs). \"others' CPU %\": the machine's CPU time other processes took during the decode "
          "runs; when another process keeps a core busy, every multi-threaded op waits for its thread on that core "
          "(a scheduler slice, ~ms), so decode with --threads > 1 slows far more than a single large streaming read.\n")
    cpp_ratios = bench_llama_cpp.ratios(results) if tools else []
    cpp_version = bench_llama_cpp.version(results) if tools else None
    if tools:
        print(llama_cpp_notes(tools, cpp_ratios, cpp_version, settings))
    if targets:
        print("| target | value | goal | met |\n|---|---|---|---|")
        for t in targets:
            print(f"| {t['target']} | {t['value']:.2f}{t['unit']} | {'<= ' if t.get('at_most') else ''}{t['goal']:g}{t['unit']} | {'yes' if t['met'] else 'NO'} |")
    payload = {"settings": settings, "machine": info, "results": results, "targets": targets}
    if tools:
        payload["llama_cpp"] = {"version": cpp_version, "ratios": cpp_ratios, "llama_bench": str(tools.bench),
                                "convert": str(tools.convert), "quantize": str(tools.quantize)}
    out_path = Path(text_flag("out", out) or "results.json").expanduser()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {out_path}")
    plot_text = text_flag("plot", plot)
    if plot_text:
        note = plot_results(results, Path(plot_text).expanduser())
        print(note if note else f"wrote {plot_text}")


if __name__ == "__main__":
    run_cli(main)
