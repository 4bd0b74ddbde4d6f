"""kernels.cpu (and kernels.dispatch on CPU): every fast path equals the reference within a stated bound.

Every test of numbers runs under each CPU cap this machine can run (``isa`` fixture: amx, avx512,
avx2, none; ``LLAMA_LITE_CPU_ISA`` picks one in production), with one tolerance for all paths.

Tolerance, per output element, with absdot = |x_eff| @ |W_deq|.T (the sum of the magnitudes of
the products; x_eff = the activations after their quantization): products are exact or rounded
once in fp32 and sums fp32 in chains of at most ~200 terms on either side (< 2^-16 absdot; AMX
splits an fp32 input into three bf16 rows that sum to it exactly): |err| <= 2^-15 absdot. fp32
outputs also meet max |err| <= 1e-5 max |ref|. bf16 outputs: both sides round to bf16, which can
differ by one bf16 ulp: + 2^-7 |ref|.
"""

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import cpu, cpu_lib, dispatch
from kernels import reference as R
from kernels.formats import Int4Weight, dequantize_weight, pack_int4, select_expert, weight_shape

from test_reference import fp8_weight, int4_weight, nvfp4_weight, w4a8_weight

EXACT = 2.0**-15

FORMATS = {
    "int4": lambda n, k, **kw: int4_weight(n, k, **kw),
    "int4_g32_fp32": lambda n, k, **kw: int4_weight(n, k, gs=32, scale_dtype=torch.float32, **kw),
    "int4_a8": lambda n, k, **kw: dataclasses.replace(int4_weight(n, k, **kw), int8_activations=True),
    "int4_a8_g32": lambda n, k, **kw: dataclasses.replace(int4_weight(n, k, gs=32, **kw), int8_activations=True),
    "fp8": lambda n, k, **kw: fp8_weight(n, k, **kw),
    "w4a8": lambda n, k, **kw: w4a8_weight(n, k, **kw),
    "w4a8_g64": lambda n, k, **kw: w4a8_weight(n, k, gs=64, **kw),
    "nvfp4": lambda n, k, **kw: nvfp4_weight(n, k, **kw),
    "nvfp4_w4a4": lambda n, k, **kw: nvfp4_weight(n, k, act=True, **kw),
}

ISAS = cpu.cpu_isas()
LIB_ISAS = [i for i in ISAS if i != "none"]


@pytest.fixture(params=ISAS)
def isa(request):
    """Run the test under each CPU cap this machine can run."""
    cpu.set_isa(request.param)
    if cpu.isa() != request.param:
        cpu.set_isa(None)
        pytest.fail(f"the {request.param} path could not be set up here (see the kernels log)")
    yield request.param
    cpu.set_isa(None)


@pytest.fixture(params=LIB_ISAS or [None])
def lib_isa(request):
    """Each cap with a C library (the activation quantizers live there)."""
    if request.param is None:
        pytest.skip("no C++ CPU path on this machine (compiler or CPU)")
    cpu.set_isa(request.param)
    yield request.param
    cpu.set_isa(None)


def effective_x(x: torch.Tensor, w) -> torch.Tensor:
    """The fp32 activations the weights multiply, after the format's activation quantization."""
    x2 = x.reshape(-1, x.shape[-1])
    if isinstance(w, (kernels.Fp8Weight, kernels.W4A8Weight)):
        xq, s = R.quantize_fp8_per_token(x2, w.activation_scale_ub)
        return xq.float() * s
    if isinstance(w, kernels.NVFP4Weight) and w.input_global_scale is not None:
        return R.fake_quantize_nvfp4_activations(x2, w.input_global_scale)
    if isinstance(w, kernels.Int4Weight) and w.int8_activations:
        return R.fake_quantize_int8_activations(x2)
    return x2.float()


def assert_close(out, ref, absdot, tol):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    ulp = 2.0**-7 if ref.dtype == torch.bfloat16 else 0.0
    out, ref = out.float().reshape(absdot.shape), ref.float().reshape(absdot.shape)
    bound = tol * absdot + ulp * ref.abs() + 1e-30
    err = (out - ref).abs()
    assert (err <= bound).all(), f"worst error / bound = {(err / bound).max().item():.3g}"
    if ulp == 0.0 and ref.numel():
        assert err.max() <= 1e-5 * ref.abs().max(), f"max error {err.max().item():.3g} vs max |ref| {ref.abs().max().item():.3g}"


def check_linear(x, w, tol):
    absdot = effective_x(x, w).abs() @ dequantize_weight(w).abs().T
    assert_close(cpu.linear(x, w), R.linear(x, w), absdot, tol)


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_matches_reference(fmt, isa):
    # 14, 17, 64, 100: the avx512 tile path's register blocks of one, two, two and two, and 3-2-2 tiles of 16 rows
    ms = (1, 3, 8, 14, 17, 64, 100)
    for k in (128, 384, 640):  # 640: not a multiple of 256
        for n in (40, 136):  # not multiples of the 32-row tiles
            w = FORMATS[fmt](n, k, seed=k + n)
            for dtype in (torch.bfloat16, torch.float32):
                # the reference is row-wise: compute it once for all batch sizes
                x_all = torch.randn(sum(ms), k, generator=torch.Generator().manual_seed(k)).to(dtype)
                ref_all = R.linear(x_all, w)
                absdot_all = effective_x(x_all, w).abs() @ dequantize_weight(w).abs().T
                r0 = 0
                for m in ms:
                    rows = slice(r0, r0 + m)
                    r0 += m
                    assert_close(cpu.linear(x_all[rows], w), ref_all[rows], absdot_all[rows], EXACT)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp32_and_3d_inputs(fmt, isa):
    w = FORMATS[fmt](72, 384)
    for shape in ((2, 3, 384), (1, 384), (40, 384)):
        x = torch.randn(*shape) * 2
        out = cpu.linear(x, w)
        assert out.shape == (*shape[:-1], 72) and out.dtype == torch.float32
        check_linear(x, w, EXACT)


def test_zero_rows(isa):
    w = FORMATS["int4"](40, 128)
    assert cpu.linear(torch.zeros(0, 128, dtype=torch.bfloat16), w).shape == (0, 40)
    out = cpu.grouped_linear(torch.randn(3, 128), torch.tensor([0, 0, 0]), FORMATS["fp8"](40, 128, lead=(2,)))
    assert torch.equal(out, torch.zeros(3, 40))


def grouped_absdot(x, off, w):
    """fp32 |x| @ |W_e|.T for each expert's rows (its effective activations), 0 outside them: the
    scale of each output's fp32 rounding error."""
    absdot = torch.zeros(x.shape[0], weight_shape(w)[1], dtype=torch.float32)
    for e in (e for e in range(len(off) - 1) if off[e + 1] > off[e]):
        we = select_expert(w, e)
        absdot[off[e] : off[e + 1]] = effective_x(x[off[e] : off[e + 1]], we).abs() @ dequantize_weight(we).abs().T
    return absdot


def grouped_reference_check(x, offsets, w, tol):
    out = cpu.grouped_linear(x, offsets, w)
    ref = R.grouped_linear(x, offsets, w)
    off = offsets.tolist()
    assert_close(out, ref, grouped_absdot(x, off, w), tol)
    outside = torch.ones(x.shape[0], dtype=torch.bool)
    outside[off[0] : off[-1]] = False
    assert (out[outside] == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_linear_with_empty_experts(fmt, isa):
    w = FORMATS[fmt](40, 640, lead=(4,), seed=3)
    for counts in ([3, 0, 5, 0], [0, 0, 0, 9], [70, 0, 1, 2]):
        t = sum(counts) + 2  # one row before and one after the routed rows
        x = torch.randn(t, 640, dtype=torch.bfloat16)
        offsets = torch.tensor([1] + [1 + sum(counts[: i + 1]) for i in range(4)])
        grouped_reference_check(x, offsets, w, EXACT)


def assert_swiglu_hidden(h, x, off, w1, w3):
    """The fused W1/W3 pass's h = silu(x W1^T) * (x W3^T) (bf16) for each expert with rows: within the
    fp32 bound of both products, plus one bf16 ulp of h."""
    for e in (e for e in range(len(off) - 1) if off[e + 1] > off[e]):
        rows = slice(off[e], off[e + 1])
        we1, we3 = select_expert(w1, e), select_expert(w3, e)
        a, b = R._linear_fp32(x[rows], we1), R._linear_fp32(x[rows], we3)
        h_ref = torch.nn.functional.silu(a) * b
        da = effective_x(x[rows], we1).abs() @ dequantize_weight(we1).abs().T
        db = effective_x(x[rows], we3).abs() @ dequantize_weight(we3).abs().T
        bound = EXACT * (1.1 * b.abs() * da + torch.nn.functional.silu(a).abs() * db) + 2.0**-7 * h_ref.abs()
        assert ((h[rows].float() - h_ref).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("fmt", ["int4", "int4_a8", "fp8", "w4a8", "nvfp4", "nvfp4_w4a4"])
def test_swiglu_matches_reference(fmt, isa):
    d, hidden = 128, 256  # W2 has K = hidden: a multiple of the int4 group size (128)
    w1, w3 = FORMATS[fmt](hidden, d, lead=(3,), seed=1), FORMATS[fmt](hidden, d, lead=(3,), seed=2)
    w2 = FORMATS[fmt](d, hidden, lead=(3,), seed=3)
    x = torch.randn(40, d, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 2, 2, 40])  # a decode-sized, an empty and a prefill-sized expert
    off = offsets.tolist()
    h = cpu._swiglu_hidden(x, off, w1, w3)
    assert_swiglu_hidden(h, x, off, w1, w3)
    # then W2 is an ordinary grouped call on that h
    out = cpu.grouped_swiglu(x, offsets, w1, w3, w2)
    assert torch.equal(out, cpu.grouped_linear(h, offsets, w2))
    ref = R.grouped_swiglu(x, offsets, w1, w3, w2)
    # end to end: a bf16 ulp of h can move an fp8 / nvfp4 activation by one step of its grid
    rel = (out.float() - ref.float()).norm() / ref.float().norm()
    assert rel < (2.0**-5 if fmt in ("fp8", "w4a8", "nvfp4_w4a4", "int4_a8") else 2.0**-7)
    # the dense form (shared expert), 3-D input
    sw = [select_expert(w, 2) for w in (w1, w3, w2)]
    xd = x.reshape(4, 10, d)
    dense = cpu.swiglu(xd, *sw)
    assert dense.shape == (4, 10, d)
    hd = cpu._swiglu_hidden(x, [0, 40], sw[0], sw[1])
    assert torch.equal(dense.reshape(40, d), cpu.linear(hd, sw[2]))


def test_activation_quantization_is_bit_identical(lib_isa):
    x = torch.randn(5, 256) * torch.tensor([1e-4, 1.0, 30.0, 3000.0, 0.0]).unsqueeze(1)
    x[1, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0]) * x[1].abs().max() / 6  # e2m1 ties
    x[2, :4] = torch.tensor([2.0**-12, -(2.0**-13), 3 * 2.0**-12, 1e-30])  # e4m3 subnormals after scaling
    form = cpu._form(fp8_weight(16, 256))
    q, s = cpu._activations(form, x, [0, 5])
    xq, s_ref = R.quantize_fp8_per_token(x, 1200.0)
    assert torch.equal(q, xq.float()) and torch.equal(s, s_ref.squeeze(1))
    w = nvfp4_weight(16, 256, act=True)
    q, _ = cpu._activations(cpu._form(w), x, [0, 5])
    values, local = R.quantize_nvfp4_activations(x, w.input_global_scale)
    assert torch.equal(q, values * local.float().repeat_interleave(16, -1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_permute_is_a_gather_with_zero_padding(dtype, lib_isa):
    """The library's gather into kernel order equals PyTorch's index_select with a zero column
    appended, for every order, with K not a multiple of the block, and for a strided x."""
    from kernels.cpu_lib import W_FP4, W_FP8, W_INT4

    libs = ["avx2"] + (["avx512"] if lib_isa in ("amx", "avx512") else [])
    for lib in libs:
        for order in ("gemv", "tile", "dp"):
            if lib == "avx2" and order != "gemv" or order == "dp" and lib != "avx512":
                continue
            for wfmt in (W_INT4, W_FP4) if order == "dp" else (W_INT4, W_FP4, W_FP8):
                for rows, k in ((1, 256), (9, 200), (70, 544)):
                    big = torch.randn(rows, k + 7).to(dtype)
                    x = big[:, 3 : 3 + k]  # row stride k + 7
                    perm = cpu._perm(lib, order, wfmt, k)
                    want = torch.cat((x, x.new_zeros(rows, 1)), dim=1).index_select(1, perm)
                    got = cpu._permute(x, lib, order, wfmt)
                    if lib == "avx2" and wfmt == W_FP8 and perm.numel() == k:
                        want = x  # fp8 decodes in K order there
                    assert got.dtype == dtype and got.is_contiguous()
                    assert torch.equal(got, want), (lib, order, wfmt, rows, k)
        # any permutation: runs of 32 spread over more than 128 values of x (copied one by one
        # where the library takes them from windows), near ones, and pads
        g = torch.Generator().manual_seed(1)
        for rows, k in ((9, 200), (70, 544)):
            x = torch.randn(rows, k).to(dtype)
            near = torch.arange(k).view(-1, 8).flip(1).flatten()
            for perm in (torch.randperm(k, generator=g), torch.cat((near[:96], torch.randperm(k, generator=g)[:99], near[-4:]))):
                perm = torch.cat((perm, torch.full((-len(perm) % 32 + 32,), k))).to(torch.int32)
                want = torch.cat((x, x.new_zeros(rows, 1)), dim=1).index_select(1, perm)
                got = torch.empty(rows, perm.numel(), dtype=dtype)
                rc = cpu_lib.library(lib).llk_gather_cols(x.data_ptr(), k, rows, k, perm.data_ptr(), perm.numel(),
                                                          got.data_ptr(), x.element_size(), 2)  # fmt: skip
                assert rc == 0 and torch.equal(got, want), (lib, rows, k)


def test_prepare_runs_once(monkeypatch):
    calls = []
    build = cpu._build_cpu_form
    monkeypatch.setattr(cpu, "_build_cpu_form", lambda w, path: calls.append(path) or build(w, path))
    w = int4_weight(40, 128, lead=(2,))
    kernels.prepare(w)
    kernels.prepare(w)
    x = torch.randn(6, 128, dtype=torch.bfloat16)
    for _ in range(3):
        kernels.grouped_linear(x, torch.tensor([0, 2, 6]), w)
    kernels.prepare(w, device="cpu")
    assert calls == [cpu.isa()] and cpu.isa() in w.prepared["cpu"]


def test_none_path_never_dequantizes_a_whole_weight(monkeypatch):
    """PyTorch only: fp8 / w4a8 / nvfp4 dequantize at most one tile of TORCH_TILE_N rows of one
    expert at a time (as does int4 where int4pack does not apply); int4 uses int4pack in fp32."""
    cpu.set_isa("none")
    try:
        sizes = []
        real = cpu.dequantize_weight
        monkeypatch.setattr(cpu, "dequantize_weight", lambda w: sizes.append(real(w).shape) or real(w))
        monkeypatch.setattr(cpu, "TORCH_TILE_N", 16)
        for fmt in ("fp8", "w4a8", "nvfp4", "int4"):
            w = FORMATS[fmt](40 if fmt == "int4" else 48, 256, lead=(3,))  # int4pack needs N % 16 == 0
            x = torch.randn(5, 256)
            offsets = torch.tensor([0, 2, 2, 5])
            grouped_reference_check(x, offsets, w, EXACT)
            assert sizes and all(s[0] <= 16 and len(s) == 2 for s in sizes)
            sizes.clear()
        w = int4_weight(48, 256)  # PyTorch's packed int4 kernel: N % 16 == 0
        assert "int4pack" in cpu.describe(w)
        for dtype in (torch.bfloat16, torch.float32):
            check_linear(torch.randn(3, 256, dtype=dtype), w, EXACT)
        assert not sizes
    finally:
        cpu.set_isa(None)


def test_without_a_compiler_the_path_is_none(monkeypatch, caplog):
    monkeypatch.delenv("LLAMA_LITE_CPU_ISA", raising=False)  # a cap set outside would skip the build
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    monkeypatch.setattr(cpu_lib, "_libs", {})
    monkeypatch.setattr(cpu_lib, "_resolved", {})
    with caplog.at_level(logging.WARNING, logger="llama_lite.kernels"):
        assert cpu.isa() == "none" and not cpu.available()
    assert any("no C++ compiler" in r.getMessage() for r in caplog.records)
    w = fp8_weight(40, 256)
    assert cpu.describe(w).startswith("cpu/none")
    check_linear(torch.randn(3, 256), w, EXACT)


# ---- the CPU cap


def test_each_cap_changes_the_logged_path(caplog):
    kernels.set_backend("auto")
    w = int4_weight(32, 128)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    seen = {}
    try:
        for cap in ISAS:
            cpu.set_isa(cap)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="llama_lite.kernels"):
                kernels.linear(x, w)
            lines = [r.getMessage() for r in caplog.records if "linear int4" in r.getMessage()]
            assert len(lines) == 1, lines
            seen[cap] = lines[0]
            assert f"cpu/{cap}:" in lines[0]
    finally:
        cpu.set_isa(None)
    assert len(set(seen.values())) == len(ISAS)


def test_caps_above_the_cpu_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="unknown CPU path 'avx1024'.*choose one of amx, avx512, avx2, none"):
        cpu.set_isa("avx1024")
    # a CPU with AVX2 only: the AVX-512 and AMX caps are refused, naming what is missing
    monkeypatch.setattr(cpu_lib, "_cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "sse2"}))
    monkeypatch.setattr(cpu_lib, "cpu_isas", lambda: ("avx2", "none"))
    for cap in ("avx512", "amx"):
        with pytest.raises(ValueError, match=rf"LLAMA_LITE_CPU_ISA={cap} needs CPU features this CPU lacks \(.*avx512f.*\); it can run: avx2, none"):
            cpu.set_isa(cap)
    monkeypatch.setattr(cpu_lib, "_checked_env", {})
    monkeypatch.setenv("LLAMA_LITE_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="lacks"):
        cpu.requested_isa()
    monkeypatch.setenv("LLAMA_LITE_CPU_ISA", "none")
    assert cpu.requested_isa() == "none"


_ONEDNN_PROBE = """
import torch
import kernels.cpu as cpu
a, b = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(256, 512, dtype=torch.bfloat16)
a @ b
print("cap", cpu.onednn_cap(), cpu.native_bf16(), cpu.describe(b.T.contiguous()))
"""


@pytest.mark.parametrize("cap", ["avx512", "avx2", "mine"])
def test_a_cap_in_the_environment_caps_onednn_too(cap):
    # A process started with LLAMA_LITE_CPU_ISA=avx512 runs PyTorch's bf16 GEMMs as a CPU without
    # AMX would (oneDNN's verbose log names the kernel it ran); a cap the user gave oneDNN stands.
    import os
    import subprocess
    import sys

    run_cap = "avx2" if cap == "mine" else cap
    if run_cap not in cpu.cpu_isas():
        pytest.skip(f"this CPU cannot run the {run_cap} cap")
    env = dict(os.environ, LLAMA_LITE_CPU_ISA=run_cap, ONEDNN_VERBOSE="1")
    env.pop("DNNL_MAX_CPU_ISA", None)
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if cap == "mine":
        env["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"
    out = subprocess.run([sys.executable, "-c", _ONEDNN_PROBE], env=env, capture_output=True, text=True, check=True,
                         timeout=300).stdout  # fmt: skip
    ran = [ln.split(",")[6] for ln in out.splitlines() if ln.startswith("onednn_verbose") and ",exec,cpu,matmul," in ln]
    cap_line = next(ln for ln in out.splitlines() if ln.startswith("cap "))
    assert all("amx" not in impl for impl in ran), ran
    if cap == "avx512":
        assert cap_line.startswith("cap AVX512_CORE_BF16 True") and "oneDNN up to AVX512_CORE_BF16" in cap_line
        assert ran and all("avx512_core_bf16" in impl for impl in ran), ran
    elif cap == "avx2":  # no bf16 instructions: bf16 GEMMs as fp32 weight tiles, as on an AVX2 laptop
        assert cap_line.startswith("cap AVX2 False") and "fp32 weight tiles" in cap_line
        assert all("avx512" not in impl for impl in ran), ran
    else:
        assert cap_line.startswith("cap AVX512_CORE_BF16 True")
        if "avx512" in cpu.cpu_isas():
            assert ran and all("avx512_core_bf16" in impl for impl in ran), ran


# ---- dispatch


@pytest.fixture
def backend():
    before = kernels.get_backend()
    yield
    kernels.set_backend(before)


def test_backend_selection_and_errors(backend, monkeypatch):
    with pytest.raises(ValueError, match="unknown kernel backend 'gpu'"):
        kernels.set_backend("gpu")
    kernels.set_backend("reference")
    assert kernels.get_backend() == "reference"
    w = fp8_weight(24, 128)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    assert torch.equal(kernels.linear(x, w), R.linear(x, w))
    kernels.set_backend("AUTO")
    assert kernels.get_backend() == "auto"
    assert dispatch._select(x)[1] == "cpu"
    monkeypatch.setattr(dispatch, "_backend", None)
    monkeypatch.setenv("LLAMA_LITE_KERNELS", "reference")
    assert kernels.get_backend() == "reference"
    monkeypatch.setattr(dispatch, "_backend", None)
    monkeypatch.setenv("LLAMA_LITE_KERNELS", "fast")
    with pytest.raises(ValueError, match="choose one of"):
        kernels.get_backend()


def test_dispatch_logs_the_path_once(backend, caplog):
    kernels.set_backend("auto")
    w = int4_weight(24, 128)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="llama_lite.kernels"):
        kernels.linear(x, w)
        kernels.linear(x, w)
    lines = [r.getMessage() for r in caplog.records if "linear int4" in r.getMessage()]
    assert len(lines) == 1 and "cpu" in lines[0]


def test_nvfp4_k_not_a_multiple_of_32(isa):
    for k in (16, 48, 80):  # partial 16-byte chunks and 64-byte blocks
        for act in (False, True):
            w = nvfp4_weight(24, k, act=act, seed=k)
            for m in (1, 5, 40):
                x = torch.randn(m, k)
                check_linear(x, w, EXACT)


def test_nvfp4_odd_count_of_64_value_chunks(isa):
    """The batch-1 nvfp4 GEMV takes two 64-value chunks per step: a row of 3 or 5 chunks ends with
    one alone."""
    for k in (192, 320):
        for act in (False, True):
            w = nvfp4_weight(24, k, act=act, seed=k)
            for m in (1, 2):
                check_linear(torch.randn(m, k), w, EXACT)
                check_linear(torch.randn(m, k, dtype=torch.bfloat16), w, EXACT)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_activations_keep_fp32_numerics(fmt, lib_isa):
    """bf16 activations (decode in a bf16 model) through the GEMV the path picks for them
    (cpu.GEMV_DOT: fp32 FMAs, or weights decoded to bf16 for vdpbf16ps with int4's group scales on
    each group's fp32 sum; many rows: llk_dpgemm on avx512, AMX tiles on amx), read in fp32 before
    any rounding: the fp32 bound against the reference on the same values, for 1 to 40 rows per
    expert, K not a multiple of 256 and empty experts."""
    for k in (128, 640):
        w = FORMATS[fmt](40, k, lead=(3,), seed=k + 7)
        form = cpu._form(w)
        if form["path"] == "torch":  # no C kernel for this layout (test_linear_matches_reference covers it)
            assert fmt == "int4_a8_g32"
            return
        for counts in ([1, 0, 2], [5, 8, 0], [17, 1, 3], [40, 0, 13]):
            off = [0, counts[0], counts[0] + counts[1], sum(counts)]
            x = torch.randn(off[-1], k, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(sum(counts)))
            ref = R.grouped_linear(x.float(), torch.tensor(off), w)
            assert_close(cpu._run(form, x, off), ref, grouped_absdot(x.float(), off, w), EXACT)


@pytest.mark.parametrize("fmt, k", [("int4", 2176), ("int4_g256", 2816), ("int4_g512", 2560), ("fp8", 2200),
                                    ("w4a8", 2176), ("nvfp4", 2176), ("nvfp4_w4a4", 2176), ("int4_a8", 2176)])  # fmt: skip
def test_long_rows_in_k_chunks(fmt, k, lib_isa):
    """Rows long enough that several activation rows overflow L1: the bf16 dot-product GEMV runs in K
    chunks (llk.cpp dp_tile; a short last chunk, chunks on group boundaries for int4's 256- and
    512-value groups; fp8 with K not a multiple of its 64-value block chunked at 8 rows, in one pass
    at 7 and fewer), and the integer GEMV of int4 with int8 activations the same way: the fp32
    bound against the reference, for the fused SwiGLU too, at row counts that split and one that
    does not."""
    make = {"int4_g256": lambda n, kk, **kw: int4_weight(n, kk, gs=256, **kw),
            "int4_g512": lambda n, kk, **kw: int4_weight(n, kk, gs=512, scale_dtype=torch.float32, **kw)}.get(fmt)
    make = make or FORMATS[fmt]
    w1, w3 = make(24, k, lead=(2,), seed=1), make(24, k, lead=(2,), seed=2)
    f1 = cpu._form(w1)
    for counts in ([8, 1], [7, 0], [2, 5]):
        off = [0, counts[0], sum(counts)]
        x = torch.randn(off[-1], k, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(sum(counts)))
        xf = x.float()
        assert_close(cpu._run(f1, x, off), R.grouped_linear(xf, torch.tensor(off), w1), grouped_absdot(xf, off, w1), EXACT)
        assert_swiglu_hidden(cpu._swiglu_hidden(x, off, w1, w3), x, off, w1, w3)


def test_int8_gemv_library_by_shape(lib_isa):
    """int4 with int8 activations takes the AVX-512 library's VNNI GEMV on amx and avx512 where K
    and the group size are multiples of 128, the AVX2 library's elsewhere: each within the fp32
    bound of the reference, for 1 to 8 rows, the fused SwiGLU too."""
    for gs, k in ((128, 640), (64, 640), (64, 576)):
        make = lambda n, kk, **kw: dataclasses.replace(int4_weight(n, kk, gs=gs, **kw), int8_activations=True)
        w1, w3 = make(24, k, lead=(2,), seed=gs), make(24, k, lead=(2,), seed=gs + 1)
        f1 = cpu._form(w1)
        vnni = lib_isa in ("amx", "avx512") and gs % 128 == 0 and k % 128 == 0
        assert cpu.q8_library(f1) is cpu_lib.library("avx512" if vnni else "avx2")
        for counts in ([1, 0], [3, 5], [8, 2]):
            off = [0, counts[0], sum(counts)]
            x = torch.randn(off[-1], k, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(k + sum(counts)))
            xf = x.float()
            assert_close(cpu._run(f1, x, off), R.grouped_linear(xf, torch.tensor(off), w1), grouped_absdot(xf, off, w1), EXACT)
            assert_swiglu_hidden(cpu._swiglu_hidden(x, off, w1, w3), x, off, w1, w3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_entry_gives_the_general_paths_bits(fmt, lib_isa):
    """One library call for decode (bf16 x in, bf16 out: cpu._decode_bf16) returns the bits of the
    general path (PyTorch's widening and gather, the fp32 GEMV, PyTorch's rounding), for dense and
    grouped weights, K not a multiple of the decode block, empty experts and the fused SwiGLU; it
    declines where activations are quantized to fp8 or nvfp4 or an expert has more rows than the GEMV takes.
    Each split is seen twice (the second call reuses the argument block kept for it), once more on one thread."""
    takes = fmt in ("int4", "int4_g32_fp32", "nvfp4", "int4_a8")
    for k in (128, 640):
        w = FORMATS[fmt](40, k, lead=(3,), seed=k)
        w3 = FORMATS[fmt](40, k, lead=(3,), seed=k + 1)
        f1, f3 = cpu._form(w), cpu._form(w3)
        if f1["path"] == "torch":  # no C kernel for this layout: PyTorch only, never this entry
            assert fmt == "int4_a8_g32"
            return
        threads = torch.get_num_threads()
        for rnd, counts in enumerate(([1, 0, 2], [0, 1, 0], [3, 5, 1]) * 3):
            torch.set_num_threads(1 if rnd >= 6 else threads)
            try:
                off = [0, counts[0], counts[0] + counts[1], sum(counts)]
                x = torch.randn(off[-1], k, dtype=torch.bfloat16)
                fast = cpu._decode_bf16(f1, x, off)
                # the amx path's GEMV takes few rows per expert (cpu.gemv_max_rows); AMX tiles above
                fits = max(counts) <= cpu.gemv_max_rows(f1)
                assert (fast is not None) == (takes and fits)
                if takes and fits:
                    assert torch.equal(fast, cpu._run(f1, x, off).to(torch.bfloat16))
                    assert torch.equal(cpu._decode_bf16(f1, x, off, f3), cpu._run(f1, x, off, f3).to(torch.bfloat16))
            finally:
                torch.set_num_threads(threads)
        # rows outside the experts, fp32 input, or more rows than the GEMV limit: the general path
        x = torch.randn(4, k, dtype=torch.bfloat16)
        assert cpu._decode_bf16(f1, x, [1, 2, 2, 3]) is None
        assert cpu._decode_bf16(f1, x, [0, 1, 1, 3]) is None  # a split kept for 3 rows, given 4
        assert cpu._decode_bf16(f1, x.float(), [0, 1, 2, 4]) is None
        many = cpu.gemv_max_rows(f1) + 1
        assert cpu._decode_bf16(f1, torch.randn(many, k, dtype=torch.bfloat16), [0, many, many, many]) is None
    if takes:  # the dense entry point takes it too
        wd = FORMATS[fmt](24, 640, seed=5)
        x = torch.randn(2, 640, dtype=torch.bfloat16)
        assert torch.equal(cpu.linear(x, wd), cpu._run(cpu._form(wd), x, [0, 2]).to(torch.bfloat16))


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_entry_gives_the_general_paths_bits(fmt, isa):
    """With many rows per expert (prefill), bf16 x and bf16 results on amx / avx512 come from the
    tile path rounded in the library (cpu._tiles_bf16): the bits of the general path (fp32 results,
    PyTorch's rounding), for dense and grouped weights, K not a multiple of 256, empty experts,
    per-token activation scales (fp8) and the fused SwiGLU. It declines on the other caps, for int8
    activations, fp32 x, rows outside the experts and an expert with few enough rows for the GEMV."""
    w = FORMATS[fmt](48, 640, lead=(3,), seed=7)
    w3 = FORMATS[fmt](48, 640, lead=(3,), seed=8)
    f1, f3 = cpu._form(w), cpu._form(w3)
    takes = isa in ("amx", "avx512") and f1["path"] != "torch" and f1["act"] != "int8"
    many = cpu.GEMV_MAX_ROWS[isa][f1["wfmt"]] + 1 if takes else 17
    for counts in ([many, 0, many + 20], [many + 3, many, 2 * many]):
        off = [0, counts[0], counts[0] + counts[1], sum(counts)]
        x = torch.randn(off[-1], 640, dtype=torch.bfloat16)
        fast = cpu._tiles_bf16(f1, x, off)
        assert (fast is not None) == takes
        if takes:
            assert torch.equal(fast, cpu._run(f1, x, off).to(torch.bfloat16))
            assert torch.equal(cpu._tiles_bf16(f1, x, off, f3), cpu._run(f1, x, off, f3).to(torch.bfloat16))
            assert torch.equal(cpu.grouped_linear(x, torch.tensor(off), w), fast)
    x = torch.randn(3 * many, 640, dtype=torch.bfloat16)
    assert cpu._tiles_bf16(f1, x, [0, many, 2 * many, 3 * many - 1]) is None  # a row outside the experts
    assert cpu._tiles_bf16(f1, x, [0, many, many + 1, 3 * many]) is None  # an expert of one row: the GEMV
    assert cpu._tiles_bf16(f1, x.float(), [0, many, 2 * many, 3 * many]) is None
    if takes:  # the dense entry point takes it too
        wd = FORMATS[fmt](24, 640, seed=5)
        x = torch.randn(many, 640, dtype=torch.bfloat16)
        assert torch.equal(cpu.linear(x, wd), cpu._run(cpu._form(wd), x, [0, many]).to(torch.bfloat16))


def test_prefill_entry_rounds_as_pytorch(isa):
    """The library's rounding of the tile path's fp32 results to bf16 is PyTorch's: to nearest, ties
    to even (down and up), subnormals kept, overflow to infinity, NaN a NaN. One-hot rows of x pick
    single weight values q * s (fp32 scales), so out[m, 0] = s[0, m // 32] for the first 160 m."""
    g = torch.Generator().manual_seed(3)
    n, k, gs = 64, 256, 32
    s = torch.rand(n, k // gs, generator=g) * 10 + 1e-3
    s[0, :5] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 2**-126 * (1 + 2**-8), 3 * 2**-135, 3.4e38])
    s[1, 0] = float("inf")  # every row of column 1: 0 x inf among the products
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    q[0, :160] = 1
    w = Int4Weight(pack_int4(q), s, gs)
    x = torch.eye(k, dtype=torch.bfloat16)
    fast = cpu._tiles_bf16(cpu._form(w), x, [0, k])
    if isa not in ("amx", "avx512"):  # the other caps round with PyTorch (the general path)
        assert fast is None
        return
    want = cpu._run(cpu._form(w), x, [0, k]).to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(fast.isnan(), nan) and nan[gs:, 1].all() and not nan[:, 0].any() and not nan[:, 2:].any()
    assert fast[:gs, 1].isinf().any()  # q x inf in the first group, each alone in its sum
    assert torch.equal(fast[~nan].view(torch.int16), want[~nan].view(torch.int16))
    first = fast[:, 0].float()
    assert first[0] == 1.0 and first[32] == 1 + 4 * 2**-8  # halfway: down to even, up to even
    # a subnormal 0.75 x 2^-133 to bf16's least one (not flushed to zero), 3.4e38 past bf16's largest
    assert first[64] == 2**-126 and first[96] == 2**-133 and first[128] == float("inf")


# ---- bf16 weights (layers a mode leaves in bf16)


# ---- bf16 weights (layers a mode leaves in bf16)


@pytest.mark.parametrize("k", [128, 200, 2048])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
def test_bf16_linear_matches_fp32_product(m, k, isa):
    """Up to BF16_GEMV_MAX_ROWS rows go through the C GEMV, more through PyTorch: both are the
    fp32 product of the bf16 values rounded once to bf16 (exact products, fp32 sums)."""
    n = 37  # not a multiple of the 16-row tile
    base = torch.randn(n, k + 8).to(torch.bfloat16)
    w = base[:, 3 : 3 + k]  # a row stride that is not K
    x = torch.randn(2, m, k).to(torch.bfloat16)
    out = cpu.linear(x, w)
    assert out.shape == (2, m, n) and out.dtype == torch.bfloat16
    ref = (x.float() @ w.float().T).to(torch.bfloat16)
    absdot = (x.float().abs() @ w.float().abs().T).reshape(-1, n)
    assert_close(out, ref, absdot, EXACT)
    # the C GEMV takes exactly the calls whose rows fit
    assert (cpu._gemv_bf16(x, w) is not None) == (isa != "none" and 2 * m <= cpu.BF16_GEMV_MAX_ROWS[isa])
    # more rows than the GEMV takes: PyTorch's GEMM (bf16, or fp32 tiles without AVX512-BF16)
    xl = torch.randn(70, k).to(torch.bfloat16)
    ref = (xl.float() @ w.float().T).to(torch.bfloat16)
    out = cpu.linear(xl, w)
    assert_close(out, ref, xl.float().abs() @ w.float().abs().T, EXACT)
    if cpu.native_bf16():  # either form of oneDNN's GEMM (chosen per CPU kind): the core's bits
        assert torch.equal(out, (w @ xl.T).T) and torch.equal(out, F.linear(xl, w))


@pytest.mark.parametrize("k, gs, sdt", [(448, 64, torch.float32), (1536, 512, torch.bfloat16),
                                        (640, 128, torch.float8_e4m3fn)])
@pytest.mark.parametrize("cap", ["amx", "avx512"])
def test_int8_activations_with_many_rows(cap, k, gs, sdt):
    """int4 x int8 with more rows than the integer GEMV takes: AMX int8 tiles (llk_amx_q8) or
    AVX-512 VNNI in registers (llk_dpq8). K with an odd number of 64-value chunks (the decoders'
    half-width tail), groups longer than their decoded block, every scale format the GEMV takes, 1
    to 5 tiles of 16 rows, empty experts and the fused SwiGLU, against the reference in fp32; the
    logged path names the kernel."""
    if cap not in ISAS:
        pytest.skip(f"this CPU cannot run the {cap} path")
    cpu.set_isa(cap)
    try:
        def weight(seed):
            return dataclasses.replace(int4_weight(72, k, gs=gs, lead=(3,), scale_dtype=sdt, seed=seed),
                                       int8_activations=True)

        w, w3 = weight(k), weight(k + 1)
        assert ("llk_amx_q8" if cap == "amx" else "llk_dpq8") in cpu.describe(w)
        limit = cpu.INT8_GEMV_MAX_ROWS[cap]
        form, form3 = cpu._form(w), cpu._form(w3)
        for counts in ([limit + 1, 0, 17], [max(70, limit + 6), 5, 0], [0, 33, limit + 2]):
            off = [0, counts[0], counts[0] + counts[1], sum(counts)]
            x = torch.randn(off[-1], k, generator=torch.Generator().manual_seed(sum(counts))) * 3
            ref = R.grouped_linear(x, torch.tensor(off), w)
            assert_close(cpu._run(form, x, off), ref, grouped_absdot(x, off, w), EXACT)
            # SwiGLU: silu of W1's products times W3's, within the fp32 bound of the reference's
            ref3 = R.grouped_linear(x, torch.tensor(off), w3)
            want = torch.nn.functional.silu(ref) * ref3
            got = cpu._run(form, x, off, form3)
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    finally:
        cpu.set_isa(None)
