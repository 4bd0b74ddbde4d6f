"""kernels.reference: the numerical definition every fast path is tested against."""

import pytest
import torch
import torch.nn.functional as F

from kernels import reference as R
from kernels.formats import (
    FP4_VALUES,
    Fp8Weight,
    Int4Weight,
    NVFP4Weight,
    W4A8Weight,
    dequantize_weight,
    fp4_codes,
    pack_fp4,
    pack_int4,
    select_expert,
    unpack_fp4,
    unpack_int4,
)

E4M3_GRID = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_GRID = E4M3_GRID[~E4M3_GRID.isnan()]


# ---- local weight builders (the quantization package is not used here on purpose)


def int4_weight(n, k, gs=128, lead=(), scale_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (*lead, n, k), generator=g, dtype=torch.int8)
    s = (torch.rand(*lead, n, k // gs, generator=g) * 0.02 + 1e-3).to(scale_dtype)
    return Int4Weight(pack_int4(q), s, gs)


def fp8_weight(n, k, lead=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(*lead, n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    return Fp8Weight(w, torch.rand(*lead, n, generator=g) * 1e-2 + 1e-4)


def w4a8_weight(n, k, gs=128, lead=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (*lead, n, k), generator=g, dtype=torch.int8)
    gsc = (torch.rand(*lead, n, k // gs, generator=g) * 50 + 0.1).to(torch.float8_e4m3fn)
    return W4A8Weight(pack_int4(q), gsc, torch.rand(*lead, n, generator=g) * 1e-3 + 1e-5, gs)


def nvfp4_weight(n, k, lead=(), act=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = FP4_VALUES[torch.randint(0, 16, (*lead, n, k), generator=g)]
    sc = (torch.rand(*lead, n, k // 16, generator=g) * 200 + 0.05).to(torch.float8_e4m3fn)
    e = lead[0] if lead else None
    gw = torch.tensor(448 * 6 / 2.0) if e is None else torch.rand(e, generator=g) * 500 + 100
    gi = None
    if act:
        gi = torch.tensor(448 * 6 / 4.0) if e is None else torch.rand(e, generator=g) * 500 + 300
    return NVFP4Weight(pack_fp4(v), sc, gw, gi)


WEIGHTS = {
    "int4": lambda n, k, **kw: int4_weight(n, k, **kw),
    "fp8": lambda n, k, **kw: fp8_weight(n, k, **kw),
    "w4a8": lambda n, k, **kw: w4a8_weight(n, k, **kw),
    "nvfp4": lambda n, k, **kw: nvfp4_weight(n, k, **kw),
    "nvfp4_w4a4": lambda n, k, **kw: nvfp4_weight(n, k, act=True, **kw),
}


# ---- linear layers


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_weight_only_is_dequantize_then_fp32_matmul(fmt):
    w = WEIGHTS[fmt](24, 256)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    expected = (x.float() @ dequantize_weight(w).T).to(torch.bfloat16)
    assert torch.equal(R.linear(x, w), expected)


@pytest.mark.parametrize("fmt", ["fp8", "w4a8"])
def test_fp8_activation_formats(fmt):
    w = WEIGHTS[fmt](24, 256)
    x = torch.randn(5, 256) * 3
    xq, s = R.quantize_fp8_per_token(x, w.activation_scale_ub)
    expected = (xq.float() @ dequantize_weight(w).T) * s
    assert torch.equal(R.linear(x, w), expected)


def test_nvfp4_activations_in_linear():
    w = WEIGHTS["nvfp4_w4a4"](24, 256)
    x = torch.randn(5, 256)
    expected = R.fake_quantize_nvfp4_activations(x, w.input_global_scale) @ dequantize_weight(w).T
    assert torch.equal(R.linear(x, w), expected)


def test_plain_weight_and_3d_input():
    w = torch.randn(12, 64, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    out = R.linear(x, w)
    assert out.shape == (2, 3, 12) and out.dtype == torch.bfloat16
    assert torch.equal(out, (x.float() @ w.float().T).to(torch.bfloat16))


def test_linear_rejects_expert_weights_and_wrong_k():
    with pytest.raises(ValueError, match="grouped_linear"):
        R.linear(torch.randn(2, 128), int4_weight(8, 128, lead=(2,)))
    with pytest.raises(ValueError, match="features"):
        R.linear(torch.randn(2, 64), int4_weight(8, 128))


def test_grouped_linear_routes_rows_and_zeroes_the_rest():
    w = int4_weight(16, 128, lead=(3,))
    x = torch.randn(9, 128)
    offsets = torch.tensor([1, 4, 4, 8])  # expert 1 has no rows; rows 0 and 8 belong to nobody
    out = R.grouped_linear(x, offsets, w)
    assert torch.equal(out[0], torch.zeros(16)) and torch.equal(out[8], torch.zeros(16))
    assert torch.equal(out[1:4], R.linear(x[1:4], select_expert(w, 0)))
    assert torch.equal(out[4:8], R.linear(x[4:8], select_expert(w, 2)))


def test_grouped_swiglu_is_swiglu_per_expert():
    w1, w3 = fp8_weight(32, 64, lead=(2,), seed=1), fp8_weight(32, 64, lead=(2,), seed=2)
    w2 = fp8_weight(64, 32, lead=(2,), seed=3)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    out = R.grouped_swiglu(x, torch.tensor([0, 2, 5]), w1, w3, w2)
    for e, rows in ((0, slice(0, 2)), (1, slice(2, 5))):
        we = [select_expert(w, e) for w in (w1, w3, w2)]
        a = R._linear_fp32(x[rows], we[0])
        b = R._linear_fp32(x[rows], we[1])
        h = (F.silu(a) * b).to(torch.bfloat16)
        assert torch.equal(out[rows], R.linear(h, we[2]))


def test_offsets_are_checked():
    w = int4_weight(8, 128, lead=(2,))
    with pytest.raises(ValueError, match="E \\+ 1"):
        R.grouped_linear(torch.randn(4, 128), torch.tensor([0, 4]), w)
    with pytest.raises(ValueError, match="non-decreasing"):
        R.grouped_linear(torch.randn(4, 128), torch.tensor([0, 3, 2]), w)


# ---- activation quantization


def test_fp8_per_token_scale_and_grid():
    x = torch.randn(6, 96) * torch.tensor([1e-3, 1.0, 10.0, 100.0, 5000.0, 0.0]).unsqueeze(1)
    xq, s = R.quantize_fp8_per_token(x, 1200.0)
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.equal(s, amax.clamp(max=1200.0).clamp(min=1e-12) / 448)
    assert xq.float().abs().max() <= 448
    assert torch.isin(xq.float(), E4M3_GRID).all()
    # rows under the bound: the largest element maps to +-448 exactly
    assert torch.equal(xq.float().abs().amax(-1)[:4], torch.full((4,), 448.0))
    # the clamped row saturates; the zero row stays zero
    assert (xq[4].float().abs() == 448).sum() > 1 and torch.equal(xq[5].float(), torch.zeros(96))
    # round to nearest: error at most half a step of the e4m3 grid (relative 2^-4, or 2^-10 absolute)
    err = (xq[:4].float() * s[:4] - x[:4]).abs()
    assert (err <= torch.maximum(x[:4].abs() * 2**-4, 2**-10 * s[:4])).all()


def test_fp8_without_upper_bound():
    x = torch.tensor([[3000.0, -1.0]])
    xq, s = R.quantize_fp8_per_token(x, None)
    assert s.item() == pytest.approx(3000 / 448) and xq.float()[0, 0] == 448


def test_e2m1_rounding_ties_to_even_and_clamps():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 7.0, 1e9, 0.0, -0.0])
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 0.5, 6.0, 6.0, 0.0, 0.0])
    assert torch.equal(R.round_to_e2m1(v), expected)
    assert torch.equal(R.round_to_e2m1(-v), -expected)
    assert torch.equal(R.round_to_e2m1(FP4_VALUES), FP4_VALUES)


def test_nvfp4_activation_scales_and_values():
    g = torch.tensor(448 * 6 / 8.0)
    x = torch.randn(3, 64) * 2
    x[1, 16:32] = 0  # an all-zero block
    values, local = R.quantize_nvfp4_activations(x, g)
    assert local.shape == (3, 4) and local.dtype == torch.float8_e4m3fn
    amax = x.unflatten(-1, (4, 16)).abs().amax(-1)
    assert torch.equal(local.float(), (amax / 6 * g).clamp(max=448).to(torch.float8_e4m3fn).float())
    assert torch.isin(values, FP4_VALUES).all()
    assert torch.equal(values[1, 16:32], torch.zeros(16))
    deq = R.fake_quantize_nvfp4_activations(x, g)
    scale = (local.float() / g).repeat_interleave(16, -1)
    assert torch.equal(deq, values * scale)
    # within half a step of the e2m1 grid (the largest step is 2, between 4 and 6)
    assert ((deq - x).abs() <= scale * 1.0 + 1e-7).all()
    with pytest.raises(ValueError, match="divisible by 16"):
        R.quantize_nvfp4_activations(torch.randn(2, 40), g)


def test_fp4_codes_round_trip_and_reject_off_grid_values():
    codes = fp4_codes(FP4_VALUES)
    assert codes.tolist() == list(range(16))  # -0.0 keeps its sign bit: code 8
    values = FP4_VALUES[torch.randint(0, 16, (33, 64))]
    back = unpack_fp4(pack_fp4(values))
    assert torch.equal(back, values) and torch.equal(torch.signbit(back), torch.signbit(values))
    assert torch.equal(pack_fp4(values.to(torch.bfloat16)), pack_fp4(values))
    assert torch.equal(fp4_codes(values.t()), fp4_codes(values.t().contiguous()))  # any strides
    # 1 + 2**-20 is 1.0 in bf16: off the grid all the same
    for bad in (0.25, 2.5, 5.0, 7.0, -12.0, 1.0 + 2**-20, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="e2m1 grid"):
            fp4_codes(torch.tensor([1.0, bad]))
    with pytest.raises(ValueError, match="e2m1 grid"):
        fp4_codes(torch.tensor([1.0, 2.5], dtype=torch.bfloat16))


def test_int8_block_quantization():
    """Per 32 values: s = amax / 127, a = round(x / s) in [-127, 127], 0 for an all-zero block;
    a * s is within s / 2 of x, and the block's largest magnitude maps to +-127."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 96, generator=g) * torch.tensor([1e-3, 1.0, 300.0]).unsqueeze(1)
    x[1, 32:64] = 0.0
    a, s = R.quantize_int8_blocks(x)
    assert a.dtype == torch.int8 and a.shape == x.shape and s.shape == (3, 3)
    assert torch.equal(s, x.abs().reshape(3, 3, 32).amax(-1) / 127)
    assert int(a.abs().max()) == 127 and bool((a[1, 32:64] == 0).all()) and s[1, 1] == 0
    blocks = a.reshape(3, 3, 32)
    assert bool((blocks.abs().amax(-1)[s > 0] == 127).all())
    deq = R.fake_quantize_int8_activations(x)
    assert bool(((deq - x).abs() <= s.repeat_interleave(32, -1) / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32])
def test_int4_packing_is_low_nibble_first_and_round_trips(dtype):
    pairs = torch.cartesian_prod(torch.arange(-8, 8), torch.arange(-8, 8))  # every (even K, odd K) pair
    packed = pack_int4(pairs.reshape(-1).to(dtype))
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [(lo & 0xF) | ((hi & 0xF) << 4) for lo, hi in pairs.tolist()]
    q = torch.randint(-8, 8, (3, 5, 64), dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)
