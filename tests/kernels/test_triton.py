"""Triton kernels on the CPU through Triton's interpreter, against a plain-torch oracle.

Shapes are tiny and blocks small (``block_config``) because the interpreter runs every program
of the grid in Python. The oracle below is written from the format definitions
(``kernels.formats.dequantize_weight``) and the activation rules in DESIGN.md, independently
of the kernels' algorithms (e.g. e2m1 rounding by nearest-grid search, e4m3 by torch's cast);
the last tests also hold the kernels to ``kernels/reference.py``, the contract of the dispatch.
What the interpreter cannot show (fp8 operand types, wgmma lowering, shared memory) is covered
by AOT-compiling the kernels for sm_90 with Triton's bundled ptxas, no GPU needed.

Tolerances. Products inside the dot are exact in both kernel and oracle (int4 x bf16 partials
scaled in fp32, e2m1 x e4m3 exact in bf16, fp8 x fp8 exact in fp32) and activation quantization is
bit-exact (checked separately), so kernel and oracle differ only in fp32 summation order
(~K * 2**-24 relative to sum |terms|) before the final bf16 rounding. We compare against the
*unrounded* fp32 oracle: bf16 round-to-nearest is off by at most half an ulp = 2**-9 relative, so
rtol = 2**-8 leaves a 2x margin, and atol = 2**-12 * max|ref| absorbs summation noise on outputs
that cancel to ~0. ``grouped_swiglu`` rounds its hidden activations to bf16 (and, for fp8 / w4a8
/ nvfp4-act, re-quantizes them), so one-ulp flips of h can move one fp8 / fp4 code: atol there is
2**-7 * max|ref|, still far below any real bug (a wrong scale, nibble or expert is O(max|ref|)).
"""

import importlib
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (it is in the test extra)")

from kernels import formats as F  # noqa: E402
from kernels.formats import Fp8Weight, Int4Weight, NVFP4Weight, W4A8Weight, select_expert  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("these tests run the Triton kernels through the interpreter on CPU tensors", allow_module_level=True)

# If another test imported the module before the variable was set, its kernels were jitted for
# a GPU; re-import so that they are interpreted.
if "kernels.triton_kernels" in sys.modules:
    TK = importlib.reload(sys.modules["kernels.triton_kernels"])
else:
    import kernels.triton_kernels as TK  # noqa: E402

import triton.language as tl  # noqa: E402

# silu(x) of a large negative x overflows exp() in numpy; the result (0) is right, as on the GPU
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

E = 3
FORMATS = ["int4", "fp8", "w4a8", "nvfp4", "nvfp4_act"]
# BLOCK_K 64 splits each 128-group over two K blocks (per-block group scales); 256 leaves a
# masked tail for K = 128 and 384 (fp8 and nvfp4 accept any K that their format allows)
BLOCK_K = {"int4": 64, "w4a8": 64, "fp8": 256, "nvfp4": 256, "nvfp4_act": 256}


def small_blocks(fmt, **kw):
    return TK.block_config(BLOCK_M=16, BLOCK_N=32, BLOCK_K=BLOCK_K[fmt], num_warps=1, num_stages=1, **kw)


# ----------------------------------------------------------------------------------------------
# oracle


def e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round to float8_e4m3fn (nearest, ties to even), saturating."""
    return v.float().clamp(-448, 448).to(torch.float8_e4m3fn).float()


def e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round to the e2m1 grid by search: nearest value, ties to the even code, clamp to +-6."""
    grid = F.FP4_VALUES[:8]
    a = v.abs().clamp(max=6.0)
    d = (a.unsqueeze(-1) - grid).abs()
    tie_break = (d > d.min(-1, keepdim=True).values).float() * 2 + (torch.arange(8) % 2)
    r = grid[tie_break.argmin(-1)]
    return torch.where(v < 0, -r, r)


def fp8_tokens(x: torch.Tensor, ub: float):
    """Per-token dynamic fp8: (xq as fp32, scale [T, 1])."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True).clamp(max=ub).clamp(min=1e-12) / 448
    return e4m3(xf / s), s


def nvfp4_tokens(x: torch.Tensor, g: torch.Tensor):
    """Dynamic nvfp4 with global scale g [T] per row -> (dequantized fp32 activations, e2m1 * local)."""
    t, k = x.shape
    xb = x.float().reshape(t, k // 16, 16)
    g = g.reshape(t, 1, 1)
    local = e4m3(xb.abs().amax(-1, keepdim=True) / 6 * g)
    scale = local / g
    q = e2m1(torch.where(scale > 0, xb / torch.where(scale > 0, scale, 1), 0))
    return (q * scale).reshape(t, k), (q * local).reshape(t, k)


def oracle_linear(x: torch.Tensor, w, expert_of_row=None) -> torch.Tensor:
    """fp32 result of the dense layer (``expert_of_row`` given: grouped, W [E, N, K])."""
    W = F.dequantize_weight(w)
    t = x.shape[0]
    rows = torch.arange(t) if expert_of_row is None else expert_of_row
    if isinstance(w, (Fp8Weight, W4A8Weight)):
        xq, s = fp8_tokens(x, w.activation_scale_ub)
    elif isinstance(w, NVFP4Weight) and w.input_global_scale is not None:
        g = w.input_global_scale.float()
        g = g[rows] if g.dim() else g.expand(t)
        xq, s = nvfp4_tokens(x, g)[0], torch.ones(t, 1)
    else:
        xq, s = x.float(), torch.ones(t, 1)
    if expert_of_row is None:
        return (xq @ W.T) * s
    out = torch.zeros(t, W.shape[-2])
    for e in range(W.shape[0]):
        m = expert_of_row == e
        out[m] = (xq[m] @ W[e].T) * s[m]
    return out


# ----------------------------------------------------------------------------------------------
# random weights in every format


def make_weight(fmt: str, n: int, k: int, e=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = () if e is None else (e,)

    def rand(*shape):
        return torch.rand(*lead, *shape, generator=g)

    packed = torch.randint(0, 256, (*lead, n, k // 2), generator=g, dtype=torch.uint8)  # every nibble
    if fmt == "int4":
        return Int4Weight(packed, (0.005 + 0.02 * rand(n, k // 128)).bfloat16(), 128)
    if fmt == "fp8":
        w = (torch.randn(*lead, n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        return Fp8Weight(w, 1e-3 + 1e-3 * rand(n))
    if fmt == "w4a8":
        return W4A8Weight(packed, (0.1 + 50 * rand(n, k // 128)).to(torch.float8_e4m3fn), 1e-3 * (1 + rand(n)), 128)
    if fmt.startswith("nvfp4"):
        gs = torch.tensor(300.0) if e is None else 200 + 200 * torch.rand(e, generator=g)
        ig = None
        if fmt == "nvfp4_act":
            ig = torch.tensor(448 * 6 / 4.0) if e is None else 448 * 6 / (3 + 2 * torch.rand(e, generator=g))
        return NVFP4Weight(packed, (0.01 + 20 * rand(n, k // 16)).to(torch.float8_e4m3fn), gs, ig)
    raise ValueError(fmt)


def make_x(t: int, k: int, seed=1, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * (0.5 + torch.rand(t, 1, generator=g) * 3)
    if t > 2:
        x[1, :16] = 0  # an all-zero nvfp4 block
        x[2, 3] = 5000.0  # a token past the fp8 activation-scale upper bound (1200)
    return x.to(dtype)


def split(t: int):
    """Offsets for E = 3 experts, the middle one empty; expert id of each row."""
    first = (t + 1) // 2
    offsets = torch.tensor([0, first, first, t], dtype=torch.long)
    expert = torch.tensor([0] * first + [2] * (t - first), dtype=torch.long)
    return offsets, expert


def check(out: torch.Tensor, ref: torch.Tensor, atol_frac=2**-12, rtol=2**-8):
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=atol_frac * ref.abs().max().item())


SHAPES = [(m, k, n) for m in (1, 5, 33) for k in (128, 384) for n in (16, 48)]


# ----------------------------------------------------------------------------------------------
# rounding and activation quantization: bit-exact


@TK.triton.jit
def _round_kernel(x_ptr, e4_ptr, e2_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(e4_ptr + i, TK._round_to_e4m3(x), mask=i < n)
    tl.store(e2_ptr + i, TK._round_to_e2m1(x), mask=i < n)


def test_rounding_helpers_match_torch_and_grid_search():
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # +0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties, including across binades and subnormals
    e2 = F.FP4_VALUES[:8]
    e2mids = (e2[1:] + e2[:-1]) / 2
    x = torch.cat([grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)),
                   e2mids, torch.tensor([449.0, 463.9, 464.0, 1e6, 7.0, 5.9, 1e-30])])  # fmt: skip
    x = torch.cat([x, -x])
    e4, e2out = torch.empty_like(x), torch.empty_like(x)
    _round_kernel[(1,)](x, e4, e2out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    assert torch.equal(e4, e4m3(x))
    assert torch.equal(e2out, e2m1(x))


def test_fp8_activation_quant_bit_exact():
    x = make_x(33, 384)
    xq, xs = TK._quantize_activations(x, make_weight("fp8", 16, 384), None)
    ref_q, ref_s = fp8_tokens(x, 1200.0)
    assert torch.equal(xs, ref_s.squeeze(1))
    assert torch.equal(xq.float(), ref_q)


@pytest.mark.parametrize("per_expert", [False, True])
def test_nvfp4_activation_quant_bit_exact(per_expert):
    x = make_x(33, 384)
    offsets, expert = split(33)
    w = make_weight("nvfp4_act", 16, 384, e=E if per_expert else None)
    xa, _ = TK._quantize_activations(x, w, offsets if per_expert else None)
    g = w.input_global_scale[expert] if per_expert else w.input_global_scale.expand(33)
    assert torch.equal(xa.float(), nvfp4_tokens(x, g)[1])  # the kernel keeps x_deq * g = e2m1 * local
    assert torch.equal(xa[1, :16].float(), torch.zeros(16))


# ----------------------------------------------------------------------------------------------
# GEMMs


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_linear(fmt, m, k, n):
    w = make_weight(fmt, n, k)
    x = make_x(m, k).reshape(1, m, k)  # leading dims are flattened and restored
    with small_blocks(fmt):
        out = TK.linear(x, w)
    assert out.shape == (1, m, n)
    check(out.reshape(m, n), oracle_linear(x.reshape(m, k), w))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_grouped_linear(fmt, m, k, n):
    w = make_weight(fmt, n, k, e=E)
    x = make_x(m, k)
    offsets, expert = split(m)
    with small_blocks(fmt):
        out = TK.grouped_linear(x, offsets, w)
    check(out, oracle_linear(x, w, expert))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 33])
def test_grouped_swiglu(fmt, m):
    k, d = 128, 128  # model dim, expert hidden dim (int4 / w4a8 groups are 128 wide along K of W2)
    w1, w3, w2 = (make_weight(fmt, n_, k_, e=E, seed=s_) for n_, k_, s_ in ((d, k, 2), (d, k, 3), (k, d, 4)))
    if fmt == "nvfp4_act":  # W1 and W3 share the calibrated input scale, as a loader would
        w3.input_global_scale = w1.input_global_scale
    x = make_x(m, k)
    offsets, expert = split(m)
    with small_blocks(fmt):
        out = TK.grouped_swiglu(x, offsets, w1, w3, w2)
    h = torch.nn.functional.silu(oracle_linear(x, w1, expert)) * oracle_linear(x, w3, expert)
    check(out, oracle_linear(h.bfloat16(), w2, expert), atol_frac=2**-7, rtol=2**-6)


@pytest.mark.parametrize("fmt", ["int4", "nvfp4_act"])
def test_grouped_rows_outside_offsets_are_zero(fmt):
    """offsets need not start at 0 nor end at T: rows no expert owns come back as zeros."""
    w = make_weight(fmt, 48, 128, e=E)
    w13 = make_weight(fmt, 128, 128, e=E, seed=5)
    x = make_x(40, 128)
    offsets = torch.tensor([2, 20, 20, 37])
    expert = torch.full((40,), -1)
    expert[2:20], expert[20:37] = 0, 2
    with small_blocks(fmt):
        out = TK.grouped_linear(x, offsets, w)
        h = TK.grouped_swiglu(x, offsets, w13, w13, w)
    check(out, oracle_linear(x, w, expert))
    assert not out[:2].any() and not out[37:].any()
    assert not h[:2].any() and not h[37:].any() and h[2:37].abs().sum(-1).min() > 0


def test_fp8_operand_dot_path():
    """The Hopper path (fp8 x fp8 tl.dot) gives the same result as the upcast path."""
    for fmt in ("fp8", "w4a8"):
        w = make_weight(fmt, 48, 384, e=E)
        x = make_x(33, 384)
        offsets, expert = split(33)
        outs = []
        for fp8_dot in (False, True):
            with small_blocks(fmt, fp8_dot=fp8_dot):
                outs.append(TK.grouped_linear(x, offsets, w))
        check(outs[1], oracle_linear(x, w, expert))
        torch.testing.assert_close(outs[0], outs[1], rtol=2**-8, atol=0)


def test_swiglu_falls_back_when_w1_w3_quantize_x_differently():
    k, d = 128, 48
    w1, w3 = make_weight("nvfp4_act", d, k, e=E, seed=2), make_weight("nvfp4_act", d, k, e=E, seed=3)
    w3.input_global_scale = w1.input_global_scale * 2
    w2 = make_weight("nvfp4", k, d, e=E, seed=4)
    x = make_x(5, k)
    offsets, expert = split(5)
    with small_blocks("nvfp4"):
        out = TK.grouped_swiglu(x, offsets, w1, w3, w2)
    # the two products stay fp32 up to SwiGLU, as in kernels.reference (no bf16 rounding of h1 / h3)
    h = torch.nn.functional.silu(oracle_linear(x, w1, expert)) * oracle_linear(x, w3, expert)
    check(out, oracle_linear(h.bfloat16(), w2, expert), atol_frac=2**-7, rtol=2**-6)
    with small_blocks("nvfp4"):  # the dense (shared-expert) SwiGLU takes the same path
        dense = TK.swiglu(x[:3], select_expert(w1, 0), select_expert(w3, 0), select_expert(w2, 0))
    check(dense, out[:3].float(), atol_frac=2**-12, rtol=2**-7)


def test_dtypes_and_errors():
    w = make_weight("int4", 16, 128)
    x = make_x(5, 128, dtype=torch.float16)
    with small_blocks("int4"):
        out = TK.linear(x, w)
        assert out.dtype == torch.float16
        torch.testing.assert_close(out.float(), oracle_linear(x, w), rtol=2**-10, atol=1e-3)
        x32 = make_x(5, 128, dtype=torch.float32)
        torch.testing.assert_close(TK.linear(x32, w), oracle_linear(x32, w), rtol=1e-5, atol=1e-5)
        assert TK.linear(make_x(0, 128), w).shape == (0, 16)
        with pytest.raises(ValueError, match="features"):
            TK.linear(make_x(5, 256), w)
        with pytest.raises(ValueError, match="grouped_linear"):
            TK.linear(make_x(5, 128), make_weight("int4", 16, 128, e=E))
        with pytest.raises(ValueError, match="multiple of the group size"):
            TK.linear(make_x(5, 48), make_weight("int4", 16, 48))
        with pytest.raises(ValueError, match="offsets"):
            TK.grouped_linear(make_x(5, 128), torch.tensor([0, 5]), make_weight("int4", 16, 128, e=E))


def test_kernels_compile_for_hopper(tmp_path):
    """AOT-compile the main variants for sm_90 with Triton's bundled ptxas: catches what the
    interpreter cannot (fp8 operand types, layouts of the reshape/split, wgmma lowering)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # cold, as in CI; and no stray cache entries
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "scripts.bench_triton", "compile_only", "--capability=90", "--quick"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    if r.returncode and "no AOT compile API" in r.stderr:
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "10 kernels compiled for sm_90" in r.stdout, r.stdout


# ----------------------------------------------------------------------------------------------
# agreement with the project's reference kernels (kernels/reference.py), the contract of dispatch


def test_activation_quant_matches_reference_module():
    ref = pytest.importorskip("kernels.reference")
    x = make_x(33, 384)
    xq, xs = TK._quantize_activations(x, make_weight("fp8", 16, 384), None)
    rq, rs = ref.quantize_fp8_per_token(x, 1200.0)
    assert torch.equal(xq.float(), rq.float()) and torch.equal(xs, rs.squeeze(-1))
    w = make_weight("nvfp4_act", 16, 384)
    xa, _ = TK._quantize_activations(x, w, None)
    values, local = ref.quantize_nvfp4_activations(x, w.input_global_scale)
    assert torch.equal(xa.float(), (values.reshape(33, -1, 16) * local.float().unsqueeze(-1)).reshape(33, 384))


@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_reference_module(fmt):
    """Both sides round fp32 values that differ only in summation order to bf16: <= 1 ulp apart."""
    ref = pytest.importorskip("kernels.reference")
    k, d = 128, 128
    w1, w3, w2 = (make_weight(fmt, n_, k_, e=E, seed=s_) for n_, k_, s_ in ((d, k, 2), (d, k, 3), (k, d, 4)))
    if fmt == "nvfp4_act":
        w3.input_global_scale = w1.input_global_scale
    x = make_x(33, k)
    offsets = torch.tensor([1, 17, 17, 30])
    with small_blocks(fmt):
        got = TK.grouped_linear(x, offsets, w1)
        got_ffn = TK.grouped_swiglu(x, offsets, w1, w3, w2)
        dense = [select_expert(w, 1) for w in (w1, w3, w2)]
        got_dense = TK.swiglu(x, *dense)  # the shared expert's dense SwiGLU
    want = ref.grouped_linear(x, offsets, w1).float()
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2**-12 * want.abs().max().item())
    want = ref.grouped_swiglu(x, offsets, w1, w3, w2).float()
    torch.testing.assert_close(got_ffn.float(), want, rtol=2**-6, atol=2**-7 * want.abs().max().item())
    want = ref.swiglu(x, *dense).float()
    torch.testing.assert_close(got_dense.float(), want, rtol=2**-6, atol=2**-7 * want.abs().max().item())
