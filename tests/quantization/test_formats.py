"""quantization.formats: round trips, the w4a8 rule, NVFP4's global scale, and
kernels.formats.dequantize_weight == qdq.fake_quantize for every format."""

import math

import pytest
import torch

from kernels.formats import Fp8Weight, Int4Weight, NVFP4Weight, W4A8Weight, dequantize_weight, unpack_fp4, unpack_int4
import quantization.formats
from quantization.formats import (
    FP8_ROWWISE_ARGS,
    FP8_TOKEN_ARGS,
    NVFP4_ACTIVATION_ARGS,
    NVFP4_WEIGHT_ARGS,
    dequantize_fp8_per_token,
    fake_quantize_nvfp4_activation,
    int4_args,
    quantize_fp8_per_token,
    quantize_fp8_rowwise,
    quantize_int4,
    quantize_nvfp4,
    quantize_w4a8,
    w4a8_from_int4,
    w4a8_naive_from_int4,
)
from quantization.qdq import compute_global_scale, compute_qparams, dequantize, fake_quantize, quantize

SHAPES = [(64, 256), (2, 32, 256)]  # a linear weight, and stacked experts [E, N, K]


@pytest.fixture(autouse=True, params=["one_block", "row_blocks"])
def block_values(request, monkeypatch):
    """Every test twice: weights quantized in one block, and one row at a time (as large weights are)."""
    if request.param == "row_blocks":
        monkeypatch.setattr(quantization.formats, "BLOCK_VALUES", 1)


def weight(shape, dtype=torch.bfloat16, std=0.02, seed=0):
    g = torch.Generator().manual_seed(seed)
    # uneven row magnitudes, like trained weights
    w = torch.randn(shape, generator=g) * std * (0.2 + torch.rand(*shape[:-1], 1, generator=g) * 2)
    return w.to(dtype)


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref = ref.double()
    return 10 * math.log10(ref.pow(2).sum() / (ref - approx.double()).pow(2).sum())


# ---------------------------------------------------------------- int4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=["2d", "3d"])
def test_int4_round_trip(shape, dtype):
    w = weight(shape, dtype)
    iw = quantize_int4(w, group_size=128)
    assert isinstance(iw, Int4Weight) and iw.group_size == 128
    q = unpack_int4(iw.qweight)
    assert q.shape == w.shape and q.min() >= -8 and q.max() <= 7
    assert iw.scales.dtype == dtype and iw.scales.shape == (*shape[:-1], shape[-1] // 128)
    args = int4_args(128)
    assert torch.equal(q, quantize(w, args, dtype=torch.int8))
    dq = dequantize_weight(iw)
    # exact in fp32: int4 x scale needs at most 4 + 8 significant bits
    assert torch.equal(dq, dequantize(q, args, iw.scales.float()))
    # qdq.fake_quantize in w's dtype rounds that same product once
    assert torch.equal(dq.to(dtype), fake_quantize(w, args))
    assert sqnr_db(w, dq) > 15


def test_int4_group_size_must_divide():
    with pytest.raises(ValueError, match="group_size 128 does not divide K=200"):
        quantize_int4(torch.randn(8, 200), group_size=128)
    assert quantize_int4(torch.randn(8, 192), group_size=64).scales.shape == (8, 3)


# ---------------------------------------------------------------- fp8


@pytest.mark.parametrize("shape", SHAPES, ids=["2d", "3d"])
def test_fp8_rowwise_round_trip(shape):
    w = weight(shape)
    fw = quantize_fp8_rowwise(w, activation_scale_ub=900.0)
    assert isinstance(fw, Fp8Weight) and fw.activation_scale_ub == 900.0
    assert fw.weight.dtype == torch.float8_e4m3fn and fw.weight.shape == w.shape
    assert fw.scale.dtype == torch.float32 and fw.scale.shape == shape[:-1]
    assert torch.equal(fw.scale, w.float().abs().amax(-1) / 448)
    assert torch.equal(dequantize_weight(fw), fake_quantize(w.float(), FP8_ROWWISE_ARGS))
    assert sqnr_db(w, dequantize_weight(fw)) > 25


def test_fp8_per_token_activations():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 64, generator=g).to(torch.bfloat16)
    x[0, 1] = 0.0  # all-zero token
    x[1, 2, 5] = 5000.0  # an outlier beyond the upper bound
    xq, s = quantize_fp8_per_token(x, scale_ub=1200.0)
    assert xq.dtype == torch.float8_e4m3fn and xq.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (2, 4, 1)
    amax = x.float().abs().amax(-1, keepdim=True)
    expect = torch.minimum(amax, torch.tensor(1200.0)) / 448
    normal = amax.squeeze(-1) > 0
    assert torch.equal(s[normal], expect[normal])
    assert s[0, 1].item() == torch.finfo(torch.float32).eps  # guarded, not 0
    assert not xq.float().isnan().any()
    assert xq[1, 2, 5].float().item() == 448.0  # clamped, not saturated to NaN
    # below the bound it is qdq's dynamic per-token fp8
    assert torch.equal(dequantize_fp8_per_token(xq, s)[0], fake_quantize(x[:1].float(), FP8_TOKEN_ARGS)[0])


# ---------------------------------------------------------------- w4a8


def test_w4a8_follows_the_divide_by_8_rule():
    w = weight((48, 512))
    iw = quantize_int4(w)
    ww = w4a8_from_int4(iw)
    assert isinstance(ww, W4A8Weight) and torch.equal(ww.qweight, iw.qweight)
    assert ww.group_scales.dtype == torch.float8_e4m3fn and ww.channel_scales.dtype == torch.float32
    assert ww.channel_scales.shape == (48,)
    s = iw.scales.float()
    chan = s.amax(-1, keepdim=True) / 448
    assert torch.equal(ww.channel_scales, (chan * 8).squeeze(-1))
    assert torch.equal(ww.group_scales, ((s / chan).to(torch.float8_e4m3fn).float() / 8).to(torch.float8_e4m3fn))
    # no fp8 saturation inside the kernel: |q| * group_scale <= 448
    q = unpack_int4(ww.qweight).float()
    gs = ww.group_scales.float().repeat_interleave(128, -1)
    assert (q.abs() * gs).max() <= 448 and ww.group_scales.float().max() == 56
    assert (q.abs().amax(-1) == 8).any()  # the bound is reached, not just met by luck
    # group x channel scale is the bf16 scale to e4m3 precision (3 mantissa bits)
    rel = (ww.group_scales.float() * ww.channel_scales[:, None] / s - 1).abs()
    assert rel.max() <= 2**-4


@pytest.mark.parametrize("shape", SHAPES, ids=["2d", "3d"])
def test_w4a8_dequantize_is_qdq(shape):
    w = weight(shape)
    ww = quantize_w4a8(w)
    q = unpack_int4(ww.qweight)
    assert torch.equal(q, quantize(w, int4_args(), dtype=torch.int8))
    # two-level scale: qdq's group dequantize with the e4m3 scales, then the channel scale
    expect = dequantize(q, int4_args(), ww.group_scales.float()) * ww.channel_scales.unsqueeze(-1)
    assert torch.equal(dequantize_weight(ww), expect)


def test_w4a8_channel_scales_beat_naive_cast_on_small_scales():
    w = weight((64, 1024), std=2e-3, seed=3)  # group scales ~1e-3: e4m3 subnormal territory
    iw = quantize_int4(w)
    assert iw.scales.float().max() < 2**-6
    ref = dequantize_weight(iw)
    good, naive = dequantize_weight(w4a8_from_int4(iw)), dequantize_weight(w4a8_naive_from_int4(iw))
    assert torch.equal(w4a8_naive_from_int4(iw).channel_scales, torch.ones(64))
    assert sqnr_db(w, good) > sqnr_db(w, naive) + 6
    # and channel scaling costs almost nothing against the bf16-scale int4 it came from
    assert sqnr_db(w, good) > sqnr_db(w, ref) - 1.5


# ---------------------------------------------------------------- nvfp4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=["2d", "3d"])
def test_nvfp4_round_trip(shape, dtype):
    w = weight(shape, dtype)
    nw = quantize_nvfp4(w)
    assert isinstance(nw, NVFP4Weight) and nw.input_global_scale is None
    assert nw.scales.dtype == torch.float8_e4m3fn and nw.scales.shape == (*shape[:-1], shape[-1] // 16)
    assert nw.global_scale.dtype == torch.float32 and nw.global_scale.shape == shape[:-2]
    # the global scale formula: 448 * 6 / amax, per tensor or per leading index (expert)
    amax = w.abs().amax(dim=(-2, -1))
    assert torch.equal(nw.global_scale, ((448 * 6) / amax).float())
    assert torch.allclose(nw.global_scale, 2688 / w.float().abs().amax(dim=(-2, -1)), rtol=2**-7)
    g = compute_global_scale(w, per_leading=len(shape) > 2)
    v = unpack_fp4(nw.qweight)
    scale, _ = compute_qparams(w, NVFP4_WEIGHT_ARGS, global_scale=g)
    assert torch.equal(v, quantize(w, NVFP4_WEIGHT_ARGS, scale, global_scale=g, dtype=torch.float32))
    assert torch.equal(nw.scales.float(), scale)
    fq = fake_quantize(w, NVFP4_WEIGHT_ARGS, global_scale=g, dtype=torch.float32)
    # kernels.formats computes (v * s) / g, compressed-tensors (and qdq) v * (s / g): the
    # two orders differ by at most one fp32 rounding
    torch.testing.assert_close(dequantize_weight(nw), fq, rtol=2**-23, atol=0)
    v, s = unpack_fp4(nw.qweight), nw.scales.float().repeat_interleave(16, -1)
    assert torch.equal(v * (s / g), fq) and torch.equal(dequantize_weight(nw), fq)
    assert sqnr_db(w, dequantize_weight(nw)) > 15


def test_nvfp4_largest_scale_uses_e4m3_range():
    w = weight((32, 64), torch.float32)
    nw = quantize_nvfp4(w)
    assert nw.scales.float().max() == 448  # the group holding amax maps to e4m3's max
    assert unpack_fp4(nw.qweight).abs().max() == 6


def test_nvfp4_activation_dynamic_local_static_global():
    g = torch.Generator().manual_seed(5)
    calib = torch.randn(4, 9, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    igs = compute_global_scale(calib)
    nw = quantize_nvfp4(weight((16, 64)), input_global_scale=igs)
    assert nw.input_global_scale is igs
    xa = fake_quantize_nvfp4_activation(x, igs)
    assert xa.dtype == x.dtype and xa.shape == x.shape
    scale, _ = compute_qparams(x, NVFP4_ACTIVATION_ARGS, global_scale=igs)
    assert torch.equal(xa, fake_quantize(x, NVFP4_ACTIVATION_ARGS, scale, global_scale=igs))
    # every 16-group of the result is e2m1 values times its own effective scale
    xa32 = fake_quantize(x, NVFP4_ACTIVATION_ARGS, scale, global_scale=igs, dtype=torch.float32)
    assert torch.equal(xa32.to(x.dtype), xa)
    q = quantize(x, NVFP4_ACTIVATION_ARGS, scale, global_scale=igs, dtype=torch.float32)
    assert set(q.abs().unique().tolist()) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
    assert torch.equal(xa32, (q.unflatten(-1, (4, 16)) * (scale / igs).unsqueeze(-1)).flatten(-2))


def test_nvfp4_needs_k_divisible_by_16():
    with pytest.raises(ValueError, match="group_size 16 does not divide the last dimension 40"):
        quantize_nvfp4(torch.randn(8, 40))


@pytest.mark.parametrize("fmt", ["int4", "fp8", "w4a8", "nvfp4"])
def test_expert_stacks_quantize_one_expert_at_a_time_to_the_same_numbers(fmt):
    """quantize_weight takes an [E, N, K] stack expert by expert, and Meta's [E, K, N] storage as a
    transposed view: the result is the whole-stack quantization's, bit for bit, and contiguous."""
    from quantization.convert import contiguous_weight, quantize_weight
    from quantization.sharding import tensor_fields

    g = torch.Generator().manual_seed(5)
    stored = (torch.randn(3, 256, 48, generator=g) * torch.rand(3, 1, 48, generator=g)).to(torch.bfloat16)
    view = stored.transpose(1, 2)  # [E, N=48, K=256], K strided
    assert torch.equal(contiguous_weight(view), view.contiguous())
    whole = {"int4": lambda w: quantize_int4(w, 128), "fp8": quantize_fp8_rowwise, "w4a8": lambda w: quantize_w4a8(w, 128),
             "nvfp4": quantize_nvfp4}[fmt](view.contiguous())
    got = quantize_weight(view, fmt, group_size=128)
    assert type(got) is type(whole)
    want, have = tensor_fields(whole), tensor_fields(got)
    assert want.keys() == have.keys()
    for name, t in want.items():
        u = have[name]
        assert u.shape == t.shape and u.dtype == t.dtype and u.is_contiguous(), name
        if t.element_size() == 1 and t.is_floating_point():
            t, u = t.view(torch.uint8), u.view(torch.uint8)
        assert torch.equal(u, t), name


def test_a_1d_weight_quantizes_as_one_block():
    """A 1-D tensor (one row without its row dimension) still quantizes, int4 and nvfp4 as qdq says."""
    w = weight((512,))
    args = int4_args(128)
    iw = quantize_int4(w)
    scale, _ = compute_qparams(w, args)
    assert torch.equal(iw.scales, scale)
    assert torch.equal(unpack_int4(iw.qweight), quantize(w, args, scale, dtype=torch.int8))
    nw = quantize_nvfp4(w)
    g = compute_global_scale(w)
    scale, _ = compute_qparams(w, NVFP4_WEIGHT_ARGS, global_scale=g)
    assert torch.equal(nw.scales.float(), scale)
    assert torch.equal(unpack_fp4(nw.qweight), quantize(w, NVFP4_WEIGHT_ARGS, scale, global_scale=g, dtype=torch.float32))
