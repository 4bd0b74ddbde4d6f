"""Benchmark the kernels per weight format and path, as ratios measured in one run.

    python -m scripts.bench_kernels [--quick] [--json out.json] [--backends cpu,reference] [--reps 7]

Cases (Llama 4 Scout: dim 5120, expert hidden 8192, 16 experts; scaled to a 2-core CPU box):
* ``expert_w1``: one expert's W1, linear [8192, 5120], batch 1 / 8 / 512.
* ``stack16``: the 16 experts' W1 stacked, linear [131072, 5120], batch 1 / 8: every format is
  larger than a 300 MiB last-level cache, so this is the memory-roofline case.
* ``moe16``: grouped SwiGLU over 16 experts at reduced dims (D 1024, F 2048), tokens routed
  top-1 round robin (batch 1 touches one expert, 512 touches all).
* ``attention``: a decode step's attention over a bf16 KV cache (``kernels.decode_attention``),
  the bench preset's heads (16 query heads, 4 KV heads, head_dim 128, batch 1), at 40, 1024 and
  8192 cached tokens ("batch" is the cache length). Bytes are the cache's keys and values; "x
  reference" is against PyTorch's SDPA (path ``sdpa``), which the core uses without the kernels.
* ``prefill_attention``: a prefill's attention (``kernels.prefill_attention``), the same heads, 128,
  512 and 2048 new tokens under a causal mask ("batch" is the token count); under caps where the
  kernel does not apply the core runs SDPA, so only the paths it applies to get a row. "x
  reference" is against SDPA; GB/s counts the keys and values once.

Formats: bf16, int4, int4_a8 (the same int4 weights with ``int8_activations``, the explicit
integer-dot-product option), fp8, w4a8, nvfp4 and nvfp4_w4a4.

Every timing is the median over ``reps`` rounds; inside a round the paths and formats alternate
with a streaming read of a buffer larger than the LLC (fp32 ``sum``, the fastest plain read we
found), so a noisy machine affects all of them alike. Reported per row: median time, weight
bytes touched / time (GB/s), that as a fraction of the streaming read, and the speedup over the
reference path and over bf16 on the same layer and batch.

Paths: ``cpu`` (kernels.cpu under the CPU cap in force; ``--isa avx2,none`` or ``--isa all`` runs it
under each cap as ``cpu/avx2`` ...), ``reference`` (kernels.reference), and ``int4pack`` (PyTorch's
``_weight_int4pack_mm_for_cpu``, int4 only, as a baseline). ``--backends`` picks among them. The
bf16 rows at many rows are PyTorch's GEMM (oneDNN), which ``--isa`` cannot cap within a process: on
an AMX CPU, ``LLAMA_LITE_CPU_ISA=avx512 python -m scripts.bench_kernels --isa avx512`` runs it as a
CPU without AMX would (the cap in the environment caps oneDNN too). Run as a program, the script sets
``OMP_WAIT_POLICY=PASSIVE`` unless it is set (see below); the JSON records the policy in force.
"""

from __future__ import annotations

import os

# Idle OpenMP threads spin by default. On a shared, oversubscribed machine (this project's 2-vCPU
# boxes) a spinning worker steals the CPU the working thread needs; measured on a fused int4 batch-8
# call: 50 ms spinning vs 0.75 ms passive, the bf16 baseline unchanged. It must be set before torch
# loads libgomp, so only when this file is the program (``python -m scripts.bench_kernels``).
if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import dataclasses
import json as _json
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import fire
import torch

from kernels import attention, cpu, reference
from kernels.memory import huge_page_copy
from kernels.formats import Fp8Weight, Int4Weight, NVFP4Weight, W4A8Weight
from quantization.sharding import tensor_fields

FORMATS = ("bf16", "int4", "int4_a8", "fp8", "w4a8", "nvfp4", "nvfp4_w4a4")


@dataclass
class Case:
    name: str
    kind: str  # "linear", "moe", "attention" or "prefill_attention" (n: query heads, k: head_dim, experts: KV heads)
    n: int  # linear: N; moe: hidden F
    k: int  # linear: K; moe: dim D
    experts: int
    batches: tuple[int, ...]
    reference_max_weights: int  # skip the reference path above this many weights (time, memory)


FULL = (
    Case("expert_w1", "linear", 8192, 5120, 1, (1, 8, 512), 8192 * 5120),
    Case("stack16", "linear", 16 * 8192, 5120, 1, (1, 8), 0),
    Case("moe16", "moe", 2048, 1024, 16, (1, 8, 512), 16 * 3 * 2048 * 1024),
    Case("attention", "attention", 16, 128, 4, (40, 1024, 8192), 0),
    Case("prefill_attention", "prefill_attention", 16, 128, 4, (128, 512, 2048), 0),
)
QUICK = (
    Case("expert_w1", "linear", 128, 256, 1, (1, 8, 32), 1 << 30),
    Case("moe4", "moe", 128, 128, 4, (1, 8, 32), 1 << 30),
    Case("attention", "attention", 8, 64, 2, (16, 100), 0),
    Case("prefill_attention", "prefill_attention", 8, 64, 2, (40,), 0),
)


# ---- random weights of each format (values do not matter for speed; layouts do)


def make_weight(fmt: str, n: int, k: int, e: Optional[int] = None, seed: int = 0):
    """A random weight of ``fmt``, its tensors in 2 MiB pages where the quantized loader puts them."""
    w = _make_weight(fmt, n, k, e, seed)
    if isinstance(w, torch.Tensor):
        return huge_page_copy(w)
    return dataclasses.replace(w, **{k: huge_page_copy(v) for k, v in tensor_fields(w).items()})


def _make_weight(fmt: str, n: int, k: int, e: Optional[int] = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lead = () if e is None else (e,)
    if fmt == "bf16":
        return torch.empty(*lead, n, k, dtype=torch.bfloat16).uniform_(-0.05, 0.05, generator=g)

    def nibbles() -> torch.Tensor:
        return torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, generator=g)

    if fmt in ("int4", "int4_a8"):  # int4_a8: the same weights with int8 activations (an explicit option)
        return Int4Weight(nibbles(), (torch.rand(*lead, n, k // 128, generator=g) * 0.01).to(torch.bfloat16), 128,
                          int8_activations=fmt == "int4_a8")
    if fmt == "fp8":
        codes = torch.randint(0, 0x7F, (*lead, n, k), dtype=torch.uint8, generator=g)  # no NaN (0x7F)
        codes |= torch.randint(0, 2, (*lead, n, k), dtype=torch.uint8, generator=g) << 7
        return Fp8Weight(codes.view(torch.float8_e4m3fn), torch.rand(*lead, n, generator=g) * 1e-3)
    if fmt == "w4a8":
        gsc = (torch.rand(*lead, n, k // 128, generator=g) * 50 + 1).to(torch.float8_e4m3fn)
        return W4A8Weight(nibbles(), gsc, torch.rand(*lead, n, generator=g) * 1e-3, 128)
    if fmt in ("nvfp4", "nvfp4_w4a4"):
        sc = (torch.rand(*lead, n, k // 16, generator=g) * 100 + 1).to(torch.float8_e4m3fn)
        gs = torch.full(lead, 2688.0) if e else torch.tensor(2688.0)
        gi = None if fmt == "nvfp4" else (torch.full(lead, 600.0) if e else torch.tensor(600.0))
        return NVFP4Weight(nibbles(), sc, gs, gi)
    raise ValueError(f"unknown format {fmt!r}")


def weight_bytes(w) -> int:
    """Bytes of one weight's stored tensors (what a bandwidth-bound kernel must read)."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    tensors = [getattr(w, f, None) for f in ("qweight", "weight", "scales", "scale", "group_scales", "channel_scales")]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# ---- the paths


def int4pack_linear(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """PyTorch's packed int4 CPU kernel (the baseline the brief names), via cpu's PyTorch-only form."""
    if "int4pack" not in w.prepared:  # bf16 scales and activations: PyTorch's fastest form of it
        packed, _, sz16 = cpu._build_cpu_form(w, "none")["int4pack"][0]
        w.prepared["int4pack"] = (packed, sz16)
    packed, sz = w.prepared["int4pack"]
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, w.group_size, sz)


def _under_cap(cap: Optional[str], fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """fn run under the CPU cap ``cap`` (None: the cap in force)."""
    def run(*args):
        if cap is not None:
            cpu.set_isa(cap)
        try:
            return fn(*args)
        finally:
            if cap is not None:
                cpu.set_isa(None)

    return run


def path_fn(path: str, case: Case, fmt: str, ws) -> Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """fn(x, offsets) for one path, or None when the path does not apply. ``cpu/ISA``: the CPU
    kernels under that cap (``cpu``: the cap in force)."""
    if path == "int4pack":
        if fmt != "int4" or case.kind != "linear":
            return None
        return lambda x, off: int4pack_linear(x, ws[0])
    if path == "reference":
        module, cap = reference, None
    else:
        module, cap = cpu, (path.split("/", 1)[1] if "/" in path else None)

    if case.kind == "linear":
        return _under_cap(cap, lambda x, off: module.linear(x, ws[0]))
    return _under_cap(cap, lambda x, off: module.grouped_swiglu(x, off, *ws))


def touched_bytes(case: Case, ws, offsets: Optional[list[int]]) -> int:
    """Weight bytes a call must read: all of a linear; the experts that have tokens in a MoE."""
    if case.kind == "linear":
        return weight_bytes(ws[0])
    active = sum(1 for a, b in zip(offsets, offsets[1:]) if b > a)
    return sum(weight_bytes(w) for w in ws) * active // case.experts


def routed(batch: int, experts: int) -> list[int]:
    """Offsets of ``batch`` tokens routed round robin (top-1): sorted by expert."""
    counts = [batch // experts + (1 if i < batch % experts else 0) for i in range(experts)]
    return [sum(counts[:i]) for i in range(experts + 1)]


# ---- measurement


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_attention(case: Case, backends: list[str], reps: int, stream: torch.Tensor) -> list[dict]:
    """The ``attention`` case: kernels.decode_attention under each cpu path against SDPA; the
    ``prefill_attention`` case: kernels.prefill_attention, a causal prefill of ``batch`` tokens."""
    rows = []
    h, d, hkv = case.n, case.k, case.experts
    prefill = case.kind == "prefill_attention"
    for n in case.batches:
        g = torch.Generator().manual_seed(n)
        q = torch.randn(1, n if prefill else 1, h, d, generator=g).to(torch.bfloat16)
        keys = torch.randn(1, n, hkv, d, generator=g).to(torch.bfloat16)
        values = torch.randn(1, n, hkv, d, generator=g).to(torch.bfloat16)
        if prefill:
            mask = torch.ones(n, n, dtype=torch.bool).tril().view(1, 1, n, n)
        else:
            mask = torch.ones(1, 1, 1, n, dtype=torch.bool)
        runs = {"sdpa": lambda: attention._sdpa(q, keys, values, mask)}
        for path in backends:
            if path.startswith("cpu"):
                cap = path.split("/", 1)[1] if "/" in path else None
                fn = attention.prefill_attention if prefill else attention.decode_attention
                run = _under_cap(cap, lambda fn=fn: fn(q, keys, values, mask))
                if run() is not None:  # prefill_attention: None under caps it does not run under
                    runs[path] = run
        for fn in runs.values():
            fn()  # warm up (builds the library)
        times = {key: [] for key in runs}
        stream_t = []
        for _ in range(reps):
            stream_t.append(_time(lambda: stream.sum()))
            for key, fn in runs.items():
                times[key].append(_time(fn))
        stream_gbs = stream.numel() * stream.element_size() / statistics.median(stream_t) / 1e9
        nbytes = 2 * n * hkv * d * 2
        sdpa_t = statistics.median(times["sdpa"])
        for path, ts in times.items():
            t = statistics.median(ts)
            rows.append(dict(case=case.name, format="bf16 KV", batch=n, path=path, ms=t * 1e3,
                             weight_mb=nbytes / 2**20, gbs=nbytes / t / 1e9, roofline=nbytes / t / 1e9 / stream_gbs,
                             stream_gbs=stream_gbs, vs_reference=sdpa_t / t, vs_bf16=None))  # fmt: skip
        what = "new tokens" if prefill else "cached tokens"
        print(f"# {case.name} {n} {what}: done (stream {stream_gbs:.1f} GB/s)", flush=True)
    return rows


def run_case(case: Case, backends: list[str], reps: int, stream: torch.Tensor) -> list[dict]:
    if case.kind in ("attention", "prefill_attention"):
        return run_attention(case, backends, reps, stream)
    print(f"# {case.name}: building weights ...", flush=True)
    weights = {}
    for i, fmt in enumerate(FORMATS):
        if case.kind == "linear":
            weights[fmt] = [make_weight(fmt, case.n, case.k, seed=i)]
        else:
            e = case.experts
            weights[fmt] = [make_weight(fmt, case.n, case.k, e, seed=3 * i), make_weight(fmt, case.n, case.k, e, seed=3 * i + 1),
                            make_weight(fmt, case.k, case.n, e, seed=3 * i + 2)]  # fmt: skip
    rows = []
    n_weights = case.n * case.k * case.experts * (3 if case.kind == "moe" else 1)
    for batch in case.batches:
        x = torch.randn(batch, case.k, dtype=torch.bfloat16)
        off = routed(batch, case.experts) if case.kind == "moe" else None
        offsets = torch.tensor(off) if off else None
        runs = {}  # (fmt, path) -> fn
        for fmt in FORMATS:
            for path in backends:
                if path == "reference" and n_weights > case.reference_max_weights:
                    continue
                fn = path_fn(path, case, fmt, weights[fmt])
                if fn is not None:
                    fn(x, offsets)  # warm up: prepare, compile, caches
                    runs[(fmt, path)] = fn
        times = {key: [] for key in runs}
        stream_t = []
        for _ in range(reps):
            stream_t.append(_time(lambda: stream.sum()))
            for key, fn in runs.items():
                times[key].append(_time(lambda: fn(x, offsets)))
        stream_gbs = stream.numel() * stream.element_size() / statistics.median(stream_t) / 1e9
        med = {key: statistics.median(v) for key, v in times.items()}
        for (fmt, path), t in med.items():
            nbytes = touched_bytes(case, weights[fmt], off)
            gbs = nbytes / t / 1e9
            ref_t = med.get((fmt, "reference"))
            bf16_t = med.get(("bf16", path)) or med.get(("bf16", "cpu")) or med.get(("bf16", f"cpu/{cpu.isa()}"))
            rows.append(dict(
                case=case.name, format=fmt, batch=batch, path=path, ms=t * 1e3, weight_mb=nbytes / 2**20,
                gbs=gbs, roofline=gbs / stream_gbs, stream_gbs=stream_gbs,
                vs_reference=(ref_t / t) if ref_t else None, vs_bf16=(bf16_t / t) if bf16_t else None,
            ))  # fmt: skip
        print(f"# {case.name} batch {batch}: done (stream {stream_gbs:.1f} GB/s)", flush=True)
    return rows


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def markdown(rows: list[dict]) -> str:
    head = "| case | format | batch | path | ms | weight MiB | GB/s | % of stream read | x reference | x bf16 |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        fx = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        lines.append(
            f"| {r['case']} | {r['format']} | {r['batch']} | {r['path']} | {r['ms']:.3f} | {r['weight_mb']:.1f} | "
            f"{r['gbs']:.1f} | {100 * r['roofline']:.0f}% | {fx(r['vs_reference'])} | {fx(r['vs_bf16'])} |"
        )
    return "\n".join(lines)


def main(quick: bool = False, json: Optional[str] = None, backends: str = "cpu,reference,int4pack",
         reps: Optional[int] = None, cases: Optional[str] = None, isa: Optional[str] = None) -> None:  # fmt: skip
    """Run the benchmark; print a markdown table; write JSON rows (and machine info) to ``json``.

    Args:
        quick: seconds-long shapes (the tests run this).
        json: write the rows and machine info to this file.
        backends: comma list of paths: cpu, reference, int4pack.
        reps: timed rounds per row (default 7, quick 3).
        cases: comma list of case names (expert_w1, stack16, moe16, attention, prefill_attention) to run; default all.
        isa: run the cpu path under each of these CPU caps (comma list of amx, avx512, avx2, none,
            or ``all`` for every cap this CPU can run); by default the cap in force only.
    """
    run(quick, json, backends, reps, cases, isa)


def run(quick: bool = False, json: Optional[str] = None, backends: str = "cpu,reference,int4pack",
        reps: Optional[int] = None, cases: Optional[str] = None, isa: Optional[str] = None) -> list[dict]:  # fmt: skip
    """``main``, returning the rows."""
    paths = [b.strip() for b in (backends.split(",") if isinstance(backends, str) else backends)]
    unknown = set(paths) - {"cpu", "reference", "int4pack"}
    if unknown:
        raise SystemExit(f"unknown path(s) {sorted(unknown)}; choose from cpu, reference, int4pack")
    if isa and "cpu" in paths:
        caps = list(cpu.cpu_isas()) if isa == "all" else [c.strip() for c in (isa.split(",") if isinstance(isa, str) else isa)]
        try:
            for cap in caps:
                cpu.set_isa(cap)  # refuses a cap this CPU cannot run
        except ValueError as err:
            raise SystemExit(str(err)) from None
        finally:
            cpu.set_isa(None)
        i = paths.index("cpu")
        paths[i : i + 1] = [f"cpu/{cap}" for cap in caps]
    selected = QUICK if quick else FULL
    if cases:
        names = set(cases.split(",") if isinstance(cases, str) else cases)
        selected = tuple(c for c in selected if c.name in names)
    reps = reps or (3 if quick else 7)
    info = dict(
        cpu=platform.processor() or platform.machine(), torch=torch.__version__, threads=torch.get_num_threads(),
        cpu_model=_cpu_model(), capability=torch.backends.cpu.get_cpu_capability(), cpu_isas=cpu.cpu_isas(),
        isa_in_force=cpu.isa(), onednn_max_isa=cpu.onednn_cap() or "(the best this CPU has)",
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "(default: spin)"),
    )  # fmt: skip
    print(f"# {info}", flush=True)
    below = [p.split("/")[1] for p in paths if p.split("/")[-1] in ("avx512", "avx2")]
    if below and "amx" in cpu.cpu_isas() and not cpu.onednn_cap():
        print(f"# note: the bf16 rows under {', '.join(below)} run PyTorch's GEMMs with AMX, as no CPU of that kind "
              f"could; start with LLAMA_LITE_CPU_ISA={below[0]} to run them as such a CPU would", flush=True)
    # the streaming-read reference, in 2 MiB pages as the weights: larger than the LLC except in --quick
    stream = huge_page_copy(torch.ones((1 << 20) if quick else (256 << 20), dtype=torch.float32))  # 4 MiB / 1 GiB
    rows = []
    for case in selected:
        rows += run_case(case, paths, reps, stream)
    table = markdown(rows)
    print(table)
    if json:
        with open(json, "w") as f:
            _json.dump(dict(info=info, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    fire.Fire(main)
