"""Benchmark the Triton MoE kernels on a CUDA GPU at Llama-4-Scout-like shapes.

    python -m scripts.bench_triton bench --out bench_triton.json
    python -m scripts.bench_triton bench --formats=int4,fp8 --batches=1,8 --sweep
    python -m scripts.bench_triton compile_only --capability=90     # no GPU needed

``bench`` times ``grouped_swiglu`` (W1 / W3 fused, then W2) per weight format and batch size on
one MoE layer: model dim 5120, expert hidden 8192, 16 experts, top-1 routing. For each it prints
and writes (JSON):
  * median time (CUDA events, after warm-up, L2 flushed before every repetition), eagerly and,
    where capture works, replayed from a CUDA graph (no CPU launch gaps);
  * weight bytes touched (only the experts that received tokens) / time, next to a
    device-to-device copy of as many bytes timed the same way in the same run (copy GB/s counts
    those bytes once, though a copy reads and writes them);
  * TFLOP/s (meaningful for prefill) and the speedup over bf16 torch: a loop of matmuls over the
    experts that have tokens, as a sparse-dispatch engine without grouped kernels runs it.
Every format is first checked against a torch reference (dequantize, matmul) at batch 8.

``compile_only`` AOT-compiles the kernel variants for a GPU architecture with Triton's bundled
ptxas, without a GPU: it catches errors the interpreter cannot (fp8 types, layouts, shared memory).
"""

import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Optional

import fire
import torch

if __package__ in (None, ""):  # run as a file: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import formats as F  # noqa: E402
from kernels.formats import Fp8Weight, Int4Weight, NVFP4Weight, W4A8Weight  # noqa: E402

FORMATS = ("int4", "fp8", "w4a8", "nvfp4", "nvfp4_act")
SWEEP = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tried by --sweep
    (16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 32, 128, 4, 6), (16, 64, 64, 4, 6),
    (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3),
    (128, 256, 64, 8, 3),
]  # fmt: skip


SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448}  # bytes per block, opt-in max


class BenchError(Exception):
    pass


def _as_list(v, cast):
    if isinstance(v, (list, tuple)):
        return [cast(x) for x in v]
    return [cast(x) for x in str(v).split(",") if x]


# ----------------------------------------------------------------------------------------------
# weights and routing


def make_weights(fmt: str, e: int, n: int, k: int, dev, gen: torch.Generator):
    """Random weights in ``fmt`` for [E, N, K], made directly on the GPU (quantizing is not the point)."""
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=dev, generator=gen)

    def rand(*shape):
        return torch.rand(*shape, device=dev, generator=gen)

    if fmt == "int4":
        return Int4Weight(packed, (0.002 + 0.004 * rand(e, n, k // 128)).bfloat16(), 128)
    if fmt == "fp8":
        w = (torch.randn(e, n, k, device=dev, generator=gen) * 64).to(torch.float8_e4m3fn)
        return Fp8Weight(w, 1e-4 * (1 + rand(e, n)))
    if fmt == "w4a8":
        return W4A8Weight(packed, (1 + 30 * rand(e, n, k // 128)).to(torch.float8_e4m3fn), 1e-4 * (1 + rand(e, n)))
    if fmt.startswith("nvfp4"):
        ig = torch.tensor(448 * 6 / 8.0, device=dev) if fmt == "nvfp4_act" else None
        scales = (1 + 100 * rand(e, n, k // 16)).to(torch.float8_e4m3fn)
        return NVFP4Weight(packed, scales, 2000 + 1000 * rand(e), ig)
    raise BenchError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")


def weight_bytes(w, experts: int) -> int:
    """Bytes of ``experts`` experts' worth of ``w`` (packed values and all scales)."""
    tensors = [t for t in vars(w).values() if isinstance(t, torch.Tensor)]
    per_expert = sum(t.numel() * t.element_size() for t in tensors if t.dim() >= 2) / w_experts(w)
    return int(per_expert * experts)


def w_experts(w) -> int:
    return (w.qweight if hasattr(w, "qweight") else w.weight).shape[0]


def route(batch: int, e: int, dev, gen: torch.Generator):
    """Top-1 routing of ``batch`` tokens; returns sorted expert ids' offsets and host counts."""
    expert = torch.zeros(batch, dtype=torch.long) if batch == 1 else torch.randint(0, e, (batch,), generator=gen)
    expert, _ = expert.sort()
    counts = torch.bincount(expert, minlength=e)
    offsets = torch.zeros(e + 1, dtype=torch.long)
    offsets[1:] = counts.cumsum(0)
    return offsets.to(dev), counts.tolist()


# ----------------------------------------------------------------------------------------------
# torch reference (exact activation quantization, dequantized weights)


def _e4m3(v):
    return v.float().clamp(-448, 448).to(torch.float8_e4m3fn).float()


def _e2m1(v):
    grid = F.FP4_VALUES.to(v.device)[:8]
    a = v.abs().clamp(max=6.0)
    d = (a.unsqueeze(-1) - grid).abs()
    key = (d > d.min(-1, keepdim=True).values).float() * 2 + (torch.arange(8, device=v.device) % 2)
    r = grid[key.argmin(-1)]
    return torch.where(v < 0, -r, r)


def ref_grouped_linear(x, counts, w):
    """fp32 result of the grouped layer, as kernels/reference.py computes it (before its final cast)."""
    W = F.dequantize_weight(w)
    if isinstance(w, (Fp8Weight, W4A8Weight)):
        s = x.float().abs().amax(-1, keepdim=True).clamp(max=w.activation_scale_ub).clamp(min=1e-12) / 448
        xq = _e4m3(x.float() / s)
    elif isinstance(w, NVFP4Weight) and w.input_global_scale is not None:
        g = w.input_global_scale.float()
        xb = x.float().reshape(x.shape[0], -1, 16)
        local = _e4m3(xb.abs().amax(-1, keepdim=True) / 6 * g)
        scale = local / g
        xq = (_e2m1(torch.where(scale > 0, xb / torch.where(scale > 0, scale, 1), 0)) * scale).reshape(x.shape)
        s = torch.ones_like(x[:, :1], dtype=torch.float32)
    else:
        xq, s = x.float(), torch.ones_like(x[:, :1], dtype=torch.float32)
    out, start = [], 0
    for e, c in enumerate(counts):
        out.append(xq[start : start + c] @ W[e].T * s[start : start + c])
        start += c
    return torch.cat(out)


def ref_swiglu(x, counts, w1, w3, w2):
    h = torch.nn.functional.silu(ref_grouped_linear(x, counts, w1)) * ref_grouped_linear(x, counts, w3)
    return ref_grouped_linear(h.to(x.dtype), counts, w2).to(x.dtype)


def bf16_swiglu(x, counts, w1, w3, w2):
    """The baseline: bf16 weights, one matmul per expert with tokens (host-side counts)."""
    out, start = [], 0
    for e, c in enumerate(counts):
        if c:
            xe = x[start : start + c]
            out.append((torch.nn.functional.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        start += c
    return torch.cat(out)


# ----------------------------------------------------------------------------------------------
# timing


class Timer:
    def __init__(self, reps: int, warmup: int, graphs: bool):
        self.reps, self.warmup, self.graphs = reps, warmup, graphs
        self.flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")  # > L2 (50 MB on H100/H200)

    def _median(self, fn) -> float:
        times = []
        for _ in range(self.reps):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def eager(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        return self._median(fn)

    def graph(self, fn) -> Optional[float]:
        if not self.graphs:
            return None
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            g.replay()
            torch.cuda.synchronize()
            return self._median(g.replay)
        except Exception as err:  # noqa: BLE001 -- a benchmark nicety, not a result
            print(f"  (CUDA graph capture failed: {type(err).__name__}: {err})")
            return None


# ----------------------------------------------------------------------------------------------
# commands


def bench(
    out: str = "bench_triton.json",
    formats=",".join(FORMATS),
    batches="1,8,512",
    dim: int = 5120,
    hidden: int = 8192,
    experts: int = 16,
    reps: int = 20,
    warmup: int = 3,
    graphs: bool = True,
    check: bool = True,
    sweep: bool = False,
    seed: int = 0,
):
    """Time grouped_swiglu per format and batch; print a markdown table and write JSON to ``out``."""
    if not torch.cuda.is_available():
        raise BenchError("bench_triton needs a CUDA GPU (torch.cuda.is_available() is False); nothing was run")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise BenchError("unset TRITON_INTERPRET: the benchmark times compiled kernels, not the interpreter")
    from kernels import triton_kernels as TK

    formats, batches = _as_list(formats, str), _as_list(batches, int)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    timer = Timer(reps, warmup, graphs)
    flops_per_token = 2 * 3 * dim * hidden

    bf16 = [torch.randn(experts, n, k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02
            for n, k in ((hidden, dim), (hidden, dim), (dim, hidden))]  # fmt: skip
    routing = {b: route(b, experts, dev, cpu_gen) for b in sorted(set(batches) | ({8} if check else set()))}
    xs = {b: torch.randn(b, dim, device=dev, generator=gen, dtype=torch.bfloat16) for b in routing}

    base = {}
    for b in batches:
        offsets, counts = routing[b]
        active = sum(c > 0 for c in counts)
        nbytes = sum(t[0].numel() * 2 for t in bf16) * active
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        base[b] = {
            "bf16_ms": timer.eager(lambda: bf16_swiglu(xs[b], counts, *bf16)),
            "bf16_graph_ms": timer.graph(lambda: bf16_swiglu(xs[b], counts, *bf16)),
            "active_experts": active,
            "src": src,
            "dst": dst,
        }
    del bf16

    rows = []
    for fmt in formats:
        shapes = ((hidden, dim), (hidden, dim), (dim, hidden))
        w1, w3, w2 = (make_weights(fmt, experts, n, k, dev, gen) for n, k in shapes)
        if fmt == "nvfp4_act":
            w3.input_global_scale = w1.input_global_scale  # shared calibration: W1 / W3 stay fused
        err = None
        if check:
            offsets, counts = routing[8]
            got = TK.grouped_swiglu(xs[8], offsets, w1, w3, w2).float()
            want = ref_swiglu(xs[8], counts, w1, w3, w2).float()
            err = ((got - want).norm() / want.norm()).item()
            status = "ok" if err < 2e-2 else "MISMATCH"
            print(f"[{fmt}] check at batch 8: relative error {err:.2e} ({status})")
        for b in batches:
            offsets, counts = routing[b]
            x = xs[b]
            nbytes = sum(weight_bytes(w, base[b]["active_experts"]) for w in (w1, w3, w2))
            src, dst = base[b]["src"][:nbytes], base[b]["dst"][:nbytes]
            copy_ms = timer.eager(lambda: dst.copy_(src))

            def run():
                return TK.grouped_swiglu(x, offsets, w1, w3, w2)

            best_cfg = None
            if sweep:
                best_cfg, best = None, math.inf
                for cfg in SWEEP:
                    bm, bn, bk, nw, ns = cfg
                    try:
                        with TK.block_config(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns):
                            ms = timer.eager(run)
                    except Exception as e:  # noqa: BLE001 -- configs may not fit; report and move on
                        print(f"  [{fmt} b={b}] {cfg}: {type(e).__name__}")
                        continue
                    print(f"  [{fmt} b={b}] {cfg}: {ms * 1e3:.1f} us")
                    if ms < best:
                        best_cfg, best = cfg, ms
            ms = timer.eager(run)
            gms = timer.graph(run)
            t = gms or ms
            rows.append({
                "format": fmt, "batch": b, "active_experts": base[b]["active_experts"],
                "ms": ms, "graph_ms": gms, "weight_bytes": nbytes,
                "gbps": nbytes / t / 1e6, "copy_ms": copy_ms, "copy_gbps": nbytes / copy_ms / 1e6,
                "frac_of_copy": copy_ms / t, "tflops": b * flops_per_token / t / 1e9,
                "bf16_ms": base[b]["bf16_ms"], "bf16_graph_ms": base[b]["bf16_graph_ms"],
                "speedup_vs_bf16": (base[b]["bf16_graph_ms"] or base[b]["bf16_ms"]) / t,
                "check_rel_err": err, "best_sweep_config": best_cfg,
            })  # fmt: skip
            r = rows[-1]
            print(f"[{fmt}] batch {b}: {t * 1e3:.1f} us, {r['gbps']:.0f} GB/s ({r['frac_of_copy']:.0%} of copy), "
                  f"{r['tflops']:.1f} TFLOP/s, x{r['speedup_vs_bf16']:.2f} vs bf16", flush=True)  # fmt: skip
        del w1, w3, w2
        torch.cuda.empty_cache()

    table = markdown(rows, torch.cuda.get_device_name(), dim, hidden, experts)
    print("\n" + table)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "shape": {"dim": dim, "hidden": hidden, "experts": experts, "routing": "top-1"},
        "timing": {"reps": reps, "warmup": warmup, "statistic": "median", "l2_flushed": True},
        "results": rows,
        "markdown": table,
    }
    Path(out).write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


def markdown(rows, device, dim, hidden, experts) -> str:
    head = (
        f"MoE layer, dim {dim}, hidden {hidden}, {experts} experts, top-1, on {device}; times are medians "
        "(CUDA graph replay where captured, else eager), weight GB/s next to a D2D copy of the same bytes\n\n"
        "| format | batch | experts hit | time (us) | eager (us) | weight MB | GB/s | copy GB/s | % of copy "
        "| TFLOP/s | bf16 (us) | speedup vs bf16 | check err |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        t = r["graph_ms"] or r["ms"]
        bf = r["bf16_graph_ms"] or r["bf16_ms"]
        err = "" if r["check_rel_err"] is None else f"{r['check_rel_err']:.1e}"
        lines.append(
            f"| {r['format']} | {r['batch']} | {r['active_experts']} | {t * 1e3:.1f} | {r['ms'] * 1e3:.1f} "
            f"| {r['weight_bytes'] / 1e6:.0f} | {r['gbps']:.0f} | {r['copy_gbps']:.0f} | {r['frac_of_copy']:.0%} "
            f"| {r['tflops']:.1f} | {bf * 1e3:.1f} | {r['speedup_vs_bf16']:.2f} | {err} |"
        )
    return "\n".join(lines)


def compile_only(capability: int = 90, quick: bool = False):
    """Compile the kernel variants for sm_<capability> without a GPU; raise on the first failure."""
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    import triton.language as tl

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as err:
        raise BenchError(f"this Triton has no AOT compile API ({err}); cannot check without a GPU") from err
    from kernels import triton_kernels as TK

    if type(TK._gemm_kernel).__name__ == "InterpretedFunction":
        raise BenchError("kernels were imported under TRITON_INTERPRET=1; run compile_only in a fresh process")
    fp8 = capability >= 89
    fn = TK._gemm_kernel
    names = fn.arg_names
    ptrs = {  # format -> (activations, weight, block scales)
        0: ("*bf16", "*u8", "*bf16"),
        1: ("*fp8e4nv", "*fp8e4nv", "*fp32"),
        2: ("*fp8e4nv", "*u8", "*fp8e4nv"),
        3: ("*bf16", "*u8", "*fp8e4nv"),
    }
    if quick:  # decode tile (mma.sync) grouped + fused SwiGLU; prefill tile (wgmma) dense
        variants = [((16, 32, 128, 4, 4), True, True), ((128, 128, 64, 8, 3), False, False)]
    else:
        variants = [(cfg, True, swiglu) for cfg in SWEEP for swiglu in (False, True)]
    done = 0
    for fmt in (0, 1, 2, 3) if fp8 else (0,):
        a_t, w_t, s_t = ptrs[fmt]
        for (bm, bn, bk, nw, ns), grouped, swiglu in variants:
            if fmt in (0, 2) and 128 % bk:
                continue
            const = dict(
                FORMAT=fmt, GROUPED=grouped, SWIGLU=swiglu, GROUP_SIZE={0: 128, 1: 1, 2: 128, 3: 16}[fmt],
                S_POW2=32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, UPCAST_A=False,
                DOT_DTYPE=tl.float8e4nv if fmt in (1, 2) else tl.bfloat16, PRECISION="tf32",
            )  # fmt: skip
            sig = {n: "i32" for n in names}
            sig.update(a_ptr=a_t, a_scale_ptr="*fp32", w_ptr=w_t, w3_ptr=w_t, s_ptr=s_t, s3_ptr=s_t,
                       c_ptr="*fp32", c3_ptr="*fp32", out_ptr="*bf16", offsets_ptr="*i64")  # fmt: skip
            sig.update({c: "constexpr" for c in const})
            # what the launcher's specialization sees at real shapes: aligned pointers, sizes
            # and strides that are multiples of 16
            aligned = [n for n in names if sig[n].startswith("*") or n.startswith("stride") or n in ("N", "K")]
            attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
            src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
            kernel = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                                    options=dict(num_warps=nw, num_stages=ns))  # fmt: skip
            smem = kernel.metadata.shared
            fits = "" if smem <= SMEM_LIMIT.get(capability, 232448) else " (over the limit: fewer stages at launch)"
            name = f"format {fmt} grouped={grouped} swiglu={swiglu} {bm}x{bn}x{bk} w{nw} s{ns}"
            print(f"sm_{capability} {name}: ok, {smem} B shared memory{fits}")
            done += 1
    for fn, sig, const in (
        (TK._quant_fp8_rows_kernel,
         dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", K="i32", stride_xm="i32", stride_qm="i32", UB="fp32"),
         dict(BLOCK_K=1024)),
        (TK._quant_nvfp4_rows_kernel,
         dict(x_ptr="*bf16", out_ptr="*bf16", g_ptr="*fp32", offsets_ptr="*i64", K="i32", stride_xm="i32",
              stride_om="i32", stride_g="i32", E="i32"),
         dict(GROUPED=True, E_POW2=16, BLOCK_K=256)),
    ):  # fmt: skip
        if not fp8:
            break
        sig.update({c: "constexpr" for c in const})
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", capability, 32))
        print(f"sm_{capability} {fn.__name__}: ok")
        done += 1
    print(f"{done} kernels compiled for sm_{capability}")


def main():
    try:
        fire.Fire({"bench": bench, "compile_only": compile_only})
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
