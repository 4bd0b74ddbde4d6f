"""quantization.qdq against compressed-tensors' own QDQ, bit for bit.

compressed-tensors has no min-max observer of its own (that lives in llm-compressor),
so for static weight scales the min/max reductions are written out here and handed to
its `calculate_qparams`; dynamic activations go through its
`compute_dynamic_scales_and_zp`. On CPU tensors compressed-tensors takes its eager
torch path (its Triton kernels require CUDA/XPU), fp4 rounding included.
"""

import pytest
import torch

from quantization.qdq import (
    QuantArgs,
    compute_global_scale,
    compute_qparams,
    dequantize,
    fake_quantize,
    from_granularity,
    quantize,
    round_to_fp4,
    scale_shape,
    to_granularity,
)

ct_args_mod = pytest.importorskip("compressed_tensors.quantization")
ct_fwd = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
ct_utils = pytest.importorskip("compressed_tensors.quantization.utils")

TYPES = {  # (num_bits, type, symmetric)
    "int4": (4, "int", True),
    "int4_asym": (4, "int", False),
    "int8": (8, "int", True),
    "int8_asym": (8, "int", False),
    "fp8": (8, "float", True),
    "fp8_asym": (8, "float", False),
    "fp4": (4, "float", True),
}
DTYPES = [torch.bfloat16, torch.float32]


def make_args(type_name: str, strategy: str, **kw) -> QuantArgs:
    nb, ty, sym = TYPES[type_name]
    return QuantArgs(num_bits=nb, type=ty, symmetric=sym, strategy=strategy, **kw)


def to_ct(a: QuantArgs):
    extra = {}
    if a.strategy == "tensor_group":  # e4m3 local scales, as compressed-tensors' NVFP4 presets
        extra["scale_dtype"] = torch.float8_e4m3fn
    return ct_args_mod.QuantizationArgs(
        num_bits=a.num_bits,
        type=a.type,
        symmetric=a.symmetric,
        strategy=a.strategy,
        group_size=a.group_size,
        block_structure=list(a.block_structure) if a.block_structure else None,
        dynamic=a.dynamic,
        **extra,
    )


def ct_static_minmax(x: torch.Tensor, a: QuantArgs):
    """Min/max per scale the way llm-compressor's min-max observer reduces a 2-D/3-D weight."""
    if a.strategy == "tensor":
        return torch.aminmax(x)
    if a.strategy == "channel":
        return x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    if a.strategy in ("group", "tensor_group"):
        g = x.unflatten(-1, (-1, a.group_size))
        return g.amin(-1), g.amax(-1)
    h, w = a.block_structure
    t = x.unflatten(-1, (-1, w)).unflatten(-3, (-1, h))  # [..., H/h, h, W/w, w]
    return t.amin(dim=(-3, -1)), t.amax(dim=(-3, -1))


def sample(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[-1], generator=g) * 3
    x[..., :3] = 0.0  # zeros, and (with the next line) one all-zero group for the zero-scale guard
    x.reshape(-1, shape[-1])[0, :32] = 0.0
    return x.to(dtype)


def assert_same(mine: torch.Tensor, theirs: torch.Tensor):
    """Same dtype, shape and value everywhere (NaN where the other has NaN; -0.0 == 0.0).

    compressed-tensors' asymmetric float zero point of an all-zero group is NaN (0/0), and
    so is llama-lite's: that is part of agreeing."""
    assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
    a, b = mine.double(), theirs.double()
    assert torch.equal(a.isnan(), b.isnan())
    ok = a.isnan() | (a == b)
    assert ok.all(), (a - b)[~ok].abs().max()


def check_against_ct(x, a, scale, zp, theirs_scale, theirs_zp, g=None):
    c = to_ct(a)
    assert_same(scale, theirs_scale)
    if zp is None:
        assert not theirs_zp.float().any()
    else:
        assert_same(zp, theirs_zp)
    q_ct = ct_fwd.quantize(x, theirs_scale, theirs_zp, c, global_scale=g)
    q = quantize(x, a, scale, zp, g, dtype=q_ct.dtype)
    assert_same(q, q_ct)
    assert_same(dequantize(q, a, scale, zp, g), ct_fwd.dequantize(q_ct, theirs_scale, theirs_zp, c, global_scale=g))
    fq_ct = ct_fwd.fake_quantize(x, theirs_scale, theirs_zp, c, global_scale=g)
    assert_same(fake_quantize(x, a, scale, zp, g, dtype=fq_ct.dtype), fq_ct)
    # the default output dtype is x's; the values are the same up to that cast
    assert_same(fake_quantize(x, a, scale, zp, g), fq_ct.to(x.dtype))


STATIC = [
    ("tensor", {}),
    ("channel", {}),
    ("group", {"group_size": 64}),
    ("tensor_group", {"group_size": 16}),
    ("block", {"block_structure": (16, 64)}),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("strategy,kw", STATIC, ids=[s for s, _ in STATIC])
def test_static_weights_match_compressed_tensors(strategy, kw, type_name, dtype):
    x = sample((32, 128), dtype)
    a = make_args(type_name, strategy, **kw)
    g = compute_global_scale(x) if strategy == "tensor_group" else None
    if g is not None:
        assert_same(g, ct_utils.generate_gparam(*torch.aminmax(x)))
    scale, zp = compute_qparams(x, a, global_scale=g)
    ct_scale, ct_zp = ct_utils.calculate_qparams(*ct_static_minmax(x, a), to_ct(a), global_scale=g)
    check_against_ct(x, a, scale, zp, ct_scale, ct_zp, g)


@pytest.mark.parametrize("type_name", ["int4", "int8_asym", "fp8", "fp4"])
@pytest.mark.parametrize("strategy,kw", STATIC[1:], ids=[s for s, _ in STATIC[1:]])
def test_stacked_expert_weights(strategy, kw, type_name):
    """[E, N, K]: one scale set per expert, as compressed-tensors gives each 2-D slice."""
    x = sample((3, 32, 128), torch.bfloat16, seed=1)
    a = make_args(type_name, strategy, **kw)
    g = compute_global_scale(x, per_leading=True) if strategy == "tensor_group" else None
    scale, zp = compute_qparams(x, a, global_scale=g)
    fq = fake_quantize(x, a, scale, zp, g)
    for e in range(x.shape[0]):
        ge = None if g is None else g[e].reshape(1)
        ct_scale, ct_zp = ct_utils.calculate_qparams(*ct_static_minmax(x[e], a), to_ct(a), global_scale=ge)
        assert_same(scale[e], ct_scale)
        ct_fq = ct_fwd.fake_quantize(x[e], ct_scale, ct_zp, to_ct(a), global_scale=ge)
        assert_same(fq[e], ct_fq.to(x.dtype))


DYNAMIC = [
    ("tensor", {}),
    ("token", {}),
    ("group", {"group_size": 32}),
    ("tensor_group", {"group_size": 16}),
]
ACT_SHAPES = [(2, 5, 128), (2, 3, 4, 128)]


@pytest.mark.parametrize("shape", ACT_SHAPES, ids=["3d", "4d"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("type_name", list(TYPES))
@pytest.mark.parametrize("strategy,kw", DYNAMIC, ids=[s for s, _ in DYNAMIC])
def test_dynamic_activations_match_compressed_tensors(strategy, kw, type_name, dtype, shape):
    x = sample(shape, dtype, seed=2)
    a = make_args(type_name, strategy, dynamic=True, **kw)
    g = compute_global_scale(x) if strategy == "tensor_group" else None
    scale, zp = compute_qparams(x, a, global_scale=g)
    # compressed-tensors' token strategy keeps dims 0 and 1 only; llama-lite's keeps every
    # leading dim. They agree on 3-D input, so give it 4-D input with dims 0-1 merged.
    x_ct = x.flatten(0, 1) if strategy == "token" and x.ndim == 4 else x
    ct_scale, ct_zp = ct_utils.compute_dynamic_scales_and_zp(x_ct, to_ct(a), None, global_scale=g)
    ct_scale, ct_zp = ct_scale.reshape(scale.shape), ct_zp.reshape(scale.shape)
    check_against_ct(x, a, scale, zp, ct_scale, ct_zp, g)


def test_token_2d_is_per_row():
    """A 2-D [T, K] activation: one scale per token (compressed-tensors would give one per tensor)."""
    x = sample((6, 64), torch.bfloat16, seed=3)
    a = make_args("fp8", "token", dynamic=True)
    scale, _ = compute_qparams(x, a)
    assert scale.shape == (6, 1)
    ct_scale, ct_zp = ct_utils.compute_dynamic_scales_and_zp(x.unsqueeze(0), to_ct(a), None)
    assert_same(scale, ct_scale[0])
    assert_same(fake_quantize(x, a), ct_fwd.fake_quantize(x.unsqueeze(0), ct_scale, ct_zp, to_ct(a))[0])


def test_local_dynamic_nvfp4_activation_static_global():
    """NVFP4 activations: local scales dynamic, global scale static (dynamic='local')."""
    x = sample((2, 7, 64), torch.bfloat16, seed=4)
    a = QuantArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, dynamic="local")
    g = compute_global_scale(x * 1.5)  # calibrated on other data
    ct_scale, ct_zp = ct_utils.compute_dynamic_scales_and_zp(x, to_ct(a), None, global_scale=g)
    scale, zp = compute_qparams(x, a, global_scale=g)
    check_against_ct(x, a, scale, zp, ct_scale, ct_zp, g)
    # fake_quantize computing its own scales is the same thing
    assert_same(fake_quantize(x, a, global_scale=g), fake_quantize(x, a, scale, zp, g))


@pytest.mark.parametrize("type_name", ["int4", "int8", "fp8", "fp4", "int4_asym"])
def test_rounding_ties_match(type_name):
    """Values exactly half-way between grid points: round half to even, as compressed-tensors."""
    a = make_args(type_name, "tensor")
    if a.type == "int":
        x = torch.arange(-300, 300) / 2.0  # every .5, and past the clamp range
    elif a.num_bits == 8:
        grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        grid = grid[torch.isfinite(grid)].unique()
        x = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([500.0, -500.0])])
    else:
        x = torch.arange(-64, 65) / 8.0  # every e2m1 threshold (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5)
    x = x.reshape(1, -1)
    scale = torch.tensor([1.0])
    zp = None if a.symmetric else torch.tensor([3], dtype=torch.int8)
    c = to_ct(a)
    q_ct = ct_fwd.quantize(x, scale, zp, c)
    assert_same(quantize(x, a, scale, zp), q_ct)
    assert_same(fake_quantize(x, a, scale, zp), ct_fwd.fake_quantize(x, scale, zp, c))


def test_round_to_fp4_grid():
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = torch.linspace(-8, 8, 4097)
    r = round_to_fp4(x)
    assert set(r.abs().unique().tolist()) <= set(grid.tolist())
    # nearest grid value (clamped at 6) everywhere
    err = (x.clamp(-6, 6) - r).abs()
    best = (x.clamp(-6, 6).abs().unsqueeze(-1) - grid).abs().min(-1).values
    assert torch.equal(err, best)
    assert round_to_fp4(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).tolist() == [
        0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0,
    ]


@pytest.mark.parametrize(
    "strategy,kw,shape,scale_shape_",
    [
        ("tensor", {}, (2, 3, 8, 32), (1,)),
        ("channel", {}, (4, 8, 32), (4, 8, 1)),
        ("token", {"dynamic": True}, (2, 3, 8, 32), (2, 3, 8, 1)),
        ("group", {"group_size": 8}, (2, 8, 32), (2, 8, 4)),
        ("tensor_group", {"group_size": 16}, (8, 32), (8, 2)),
        ("block", {"block_structure": (4, 8)}, (3, 8, 32), (3, 2, 4)),
    ],
)
def test_granularity_view_round_trip(strategy, kw, shape, scale_shape_):
    a = QuantArgs(strategy=strategy, **kw)
    x = torch.randn(shape)
    v = to_granularity(x, a)
    assert torch.equal(from_granularity(v, a, x.shape), x)
    assert scale_shape(x.shape, a) == scale_shape_
    assert compute_qparams(x, a)[0].shape == scale_shape_
    if strategy == "block":  # each view row is one 4x8 tile
        assert torch.equal(v[1, 1, 2], x[1, 4:8, 16:24].flatten())


def test_asymmetric_zero_point_is_used():
    x = torch.rand(4, 64) + 0.5  # all positive: asymmetric range beats symmetric
    sym, asym = make_args("int4", "channel"), make_args("int4_asym", "channel")
    _, zp = compute_qparams(x, asym)
    assert zp.dtype == torch.int8 and (zp == -8).all()
    assert (fake_quantize(x, asym) - x).abs().max() < (fake_quantize(x, sym) - x).abs().max()


@pytest.mark.parametrize(
    "shape,args,match",
    [
        ((4, 100), dict(num_bits=4, strategy="group", group_size=128), "group_size 128 does not divide the last dimension 100"),
        ((2, 3, 100), dict(num_bits=4, type="float", strategy="tensor_group", group_size=16), "group_size 16 does not divide"),
        ((100, 128), dict(type="float", strategy="block", block_structure=(128, 128)), r"block_structure \[128, 128\] does not tile"),
        ((128, 96), dict(type="float", strategy="block", block_structure=(64, 64)), "does not tile"),
        ((64,), dict(strategy="channel"), "needs at least 2 dimensions"),
    ],
)
def test_shapes_that_do_not_divide_raise(shape, args, match):
    a = QuantArgs(**args)
    x = torch.randn(shape)
    for fn in (lambda: compute_qparams(x, a), lambda: quantize(x, a), lambda: fake_quantize(x, a)):
        with pytest.raises(ValueError, match=match):
            fn()


def test_scale_of_the_wrong_shape_raises():
    a = QuantArgs(strategy="channel")
    with pytest.raises(ValueError, match=r"scale of shape \(8,\) does not fit the 'channel' scale shape \(8, 1\)"):
        quantize(torch.randn(8, 16), a, scale=torch.ones(8))
    with pytest.raises(ValueError, match="zero_point was given without its scale"):
        quantize(torch.randn(8, 16), a, zero_point=torch.zeros(8, 1))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(type="float", num_bits=6), "float quantization supports 8 .e4m3. and 4 .e2m1. bits"),
        (dict(type="float", num_bits=4, symmetric=False), "must be symmetric"),
        (dict(type="uint"), "type must be"),
        (dict(num_bits=9), "2 to 8 bits"),
        (dict(strategy="group"), "needs a positive group_size"),
        (dict(strategy="channel", group_size=128), "group_size is only meaningful"),
        (dict(strategy="block"), "needs block_structure"),
        (dict(strategy="block", block_structure=(0, 4)), "needs block_structure"),
        (dict(block_structure=(4, 4)), "block_structure is only meaningful"),
        (dict(strategy="token"), "needs dynamic=True"),
        (dict(strategy="channel", dynamic=True), "dynamic scales are supported for"),
        (dict(strategy="group", group_size=16, dynamic="local"), "needs strategy 'tensor_group'"),
        (dict(strategy="rows"), "strategy must be one of"),
    ],
)
def test_invalid_args_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        QuantArgs(**kw)
