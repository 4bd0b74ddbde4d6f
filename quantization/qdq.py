"""QDQ reference: quantize, dequantize and fake-quantize for every format llama-lite knows.

This file is the numerical ground truth for every format and kernel. Its semantics are
those of compressed-tensors' QDQ (``compressed_tensors.quantization.lifecycle.forward``),
and it agrees with it bit for bit wherever both define a case (tests/quantization/test_qdq.py).

How it is built: ``to_granularity`` views ``x`` so that every group of elements that
shares one scale lies along the last dimension; the scale (and zero point) then has
exactly the shape of that view without its last dimension. Scale computation, quantize
and dequantize all work on that view, and ``from_granularity`` puts the result back.

Scale shapes per strategy, for ``x`` of shape ``[..., N, K]``:
  tensor        [1]
  channel       [..., N, 1]        (one per row of the last dimension)
  token         [..., N, 1]        (same granularity, for dynamic activations)
  group         [..., N, K // group_size]
  tensor_group  [..., N, K // group_size], e4m3-valued, plus a global scale
  block         [..., N // h, K // w]   for block_structure [h, w]

Where llama-lite defines things differently from compressed-tensors:
- token strategy: one scale per row of the last dimension, whatever the number of
  leading dims. compressed-tensors keeps dims 0 and 1 and reduces the rest, so a 2-D
  [T, K] input gets a single (per-tensor) scale and a 4-D [B, S, H, D] input one per
  (B, S). For 3-D [B, S, K] activations the two agree.
- block strategy: dimensions that the block does not divide are a ValueError here;
  compressed-tensors pads with zeros. It also handles 2-D tensors only; here any
  leading dims are allowed.
- output dtype: fake_quantize/quantize return x.dtype unless `dtype` is given;
  compressed-tensors returns x.dtype for group/tensor_group but the promoted
  (x, scale) dtype for tensor/channel/token/block.
- symmetric args: compute_qparams returns zero_point=None (compressed-tensors returns
  zeros, which only changes the sign of a zero result).
- tensor_group always has e4m3-valued local scales (compressed-tensors: when the args'
  scale_dtype is float8_e4m3fn, as in its NVFP4 presets).
- scales or global scales given as float8 tensors are read as float32.
"""

from dataclasses import dataclass
from typing import Optional, Union

import torch

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0

STRATEGIES = ("tensor", "channel", "group", "tensor_group", "block", "token")
# compressed-tensors computes scales on the fly only for these
_DYNAMIC_STRATEGIES = ("tensor", "token", "group", "tensor_group")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)



@dataclass(frozen=True)
class QuantArgs:
    """How to quantize one tensor; field names and meanings follow compressed-tensors."""

    num_bits: int = 8
    type: str = "int"  # "int" or "float" (float: 8 -> e4m3, 4 -> e2m1)
    symmetric: bool = True
    strategy: str = "tensor"
    group_size: Optional[int] = None
    block_structure: Optional[tuple[int, int]] = None  # [rows, cols] of one tile
    dynamic: Union[bool, str] = False  # True, False or "local" (tensor_group: local scales dynamic)

    def __post_init__(self) -> None:
        if self.type not in ("int", "float"):
            raise ValueError(f"type must be 'int' or 'float', not {self.type!r}.")
        if self.type == "int" and not 2 <= self.num_bits <= 8:
            raise ValueError(f"int quantization supports 2 to 8 bits, not {self.num_bits}.")
        if self.type == "float" and self.num_bits not in (8, 4):
            raise ValueError(f"float quantization supports 8 (e4m3) and 4 (e2m1) bits, not {self.num_bits}.")
        if self.type == "float" and self.num_bits == 4 and not self.symmetric:
            raise ValueError("fp4 (e2m1) quantization must be symmetric.")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, not {self.strategy!r}.")
        grouped = self.strategy in ("group", "tensor_group")
        if grouped and (self.group_size is None or self.group_size <= 0):
            raise ValueError(f"strategy {self.strategy!r} needs a positive group_size.")
        if not grouped and self.group_size is not None:
            raise ValueError("group_size is only meaningful for the 'group' and 'tensor_group' strategies.")
        if self.strategy == "block":
            bs = self.block_structure
            if bs is None or len(bs) != 2 or not all(isinstance(v, int) and v > 0 for v in bs):
                raise ValueError("strategy 'block' needs block_structure as two positive ints [rows, cols].")
            object.__setattr__(self, "block_structure", (int(bs[0]), int(bs[1])))
        elif self.block_structure is not None:
            raise ValueError("block_structure is only meaningful for the 'block' strategy.")
        if self.dynamic not in (True, False, "local"):
            raise ValueError(f"dynamic must be True, False or 'local', not {self.dynamic!r}.")
        if self.strategy == "token" and self.dynamic is not True:
            raise ValueError("the 'token' strategy is for dynamic activations and needs dynamic=True.")
        if self.dynamic is True and self.strategy not in _DYNAMIC_STRATEGIES:
            raise ValueError(f"dynamic scales are supported for {_DYNAMIC_STRATEGIES}, not {self.strategy!r}.")
        if self.dynamic == "local" and self.strategy != "tensor_group":
            raise ValueError("dynamic='local' (dynamic local scales, static global) needs strategy 'tensor_group'.")

    @property
    def qrange(self) -> tuple[float, float]:
        """(smallest, largest) quantized value."""
        if self.type == "int":
            return -(2.0 ** (self.num_bits - 1)), 2.0 ** (self.num_bits - 1) - 1
        m = FP8_E4M3_MAX if self.num_bits == 8 else FP4_E2M1_MAX
        return -m, m


# ---------------------------------------------------------------- granularity


def to_granularity(x: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """View ``x`` as ``[*scale_shape, elements_per_scale]``: each scale's elements on the last dim.

    The only place that knows how a strategy maps elements to scales. Raises ValueError
    when the shape does not divide into the strategy's groups or tiles.
    """
    s = args.strategy
    if s == "tensor":
        return x.reshape(-1)
    if s in ("channel", "token", "block") and x.ndim < 2:
        raise ValueError(f"strategy {s!r} needs at least 2 dimensions, got shape {tuple(x.shape)}.")
    if s in ("channel", "token"):
        return x.unsqueeze(-2)
    if s in ("group", "tensor_group"):
        k, g = x.shape[-1], args.group_size
        if k % g:
            raise ValueError(f"group_size {g} does not divide the last dimension {k} of shape {tuple(x.shape)}.")
        return x.unflatten(-1, (k // g, g))
    # block: [..., H, W] -> [..., H/h, W/w, h*w]
    (h, w), (rows, cols) = args.block_structure, x.shape[-2:]
    if rows % h or cols % w:
        raise ValueError(
            f"block_structure [{h}, {w}] does not tile the last two dimensions of shape {tuple(x.shape)}."
        )
    tiles = x.unflatten(-1, (cols // w, w)).unflatten(-3, (rows // h, h))  # [..., H/h, h, W/w, w]
    return tiles.transpose(-3, -2).flatten(-2)


def from_granularity(v: torch.Tensor, args: QuantArgs, shape: torch.Size) -> torch.Tensor:
    """Inverse of ``to_granularity``: back to ``shape``."""
    if args.strategy == "block":
        h, w = args.block_structure
        v = v.unflatten(-1, (h, w)).transpose(-3, -2)  # [..., H/h, h, W/w, w]
    return v.reshape(shape)


def _param_shape(x_shape: torch.Size, args: QuantArgs) -> torch.Size:
    # the granular view's shape without its last dim; () for the tensor strategy
    return to_granularity(torch.empty(x_shape, device="meta"), args).shape[:-1]


def scale_shape(x_shape: torch.Size, args: QuantArgs) -> torch.Size:
    """Shape of the scale ``compute_qparams`` returns for a tensor of ``x_shape``."""
    return _param_shape(x_shape, args) or torch.Size([1])


def _as_param(p: torch.Tensor, pshape: torch.Size, args: QuantArgs, name: str) -> torch.Tensor:
    """Check that a scale-like tensor broadcasts to the scale shape; make it at least 1-D.

    At least 1-D because 0-dim tensors do not take part in dtype promotion: an fp32
    scale must promote bf16 arithmetic to fp32 whatever its shape.
    """
    if p.dtype in _FP8_DTYPES:
        p = p.float()
    if p.numel() == 1:
        return p.reshape(1)
    try:
        ok = torch.broadcast_shapes(p.shape, pshape) == pshape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"{name} of shape {tuple(p.shape)} does not fit the {args.strategy!r} scale shape {tuple(pshape)}."
        )
    return p


def _on_view(p: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A param (scale shape) -> broadcastable against the granular view (one more dim)."""
    if p is None or p.numel() == 1:
        return p
    return p.unsqueeze(-1)


# ---------------------------------------------------------------- rounding


_SIGN_AND_EXPONENT = -(1 << 23)  # 0xFF800000 as an int32


def round_to_fp4(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value (0, .5, 1, 1.5, 2, 3, 4, 6 and negatives), ties to even, saturating at 6."""
    mag = x.abs().clamp(max=FP4_E2M1_MAX).float()
    # e2m1 spacing is 0.5 below 2 (incl. the subnormal 0.5), 1 in [2, 4), 2 in [4, 6]: half the
    # power of two at or below clamp(mag, 1, 4), which is its fp32 bits without the mantissa
    # (3x faster than a torch.where on scalars). Dividing by a power of two is exact, so
    # torch.round's half-to-even is e2m1's.
    step = (mag.clamp(1.0, 4.0).view(torch.int32) & _SIGN_AND_EXPONENT).view(torch.float32) * 0.5
    r = torch.round(mag / step) * step
    return torch.copysign(r, x).to(x.dtype)


def _round_to_grid(t: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """Clamp to the quantized range, then round to the nearest representable value (dtype kept)."""
    lo, hi = args.qrange
    t = t.clamp(lo, hi)
    if args.type == "int":
        return torch.round(t)  # half to even
    if args.num_bits == 8:
        return t.to(torch.float8_e4m3fn).to(t.dtype)
    return round_to_fp4(t)


def _round_scale_to_fp8(s: torch.Tensor) -> torch.Tensor:
    return s.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(s.dtype)


# ---------------------------------------------------------------- qparams


def _qparams_from_minmax(
    lo: torch.Tensor, hi: torch.Tensor, args: QuantArgs, global_scale: Optional[torch.Tensor]
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    # zero must stay exactly representable, so the range always contains it
    lo = torch.minimum(lo, torch.zeros_like(lo))
    hi = torch.maximum(hi, torch.zeros_like(hi))
    # 0-dim fp32 tensors, not Python floats: with a 0-dim lo (tensor strategy) they
    # promote the zero-point arithmetic to fp32, exactly as compressed-tensors does
    qmin, qmax = (torch.tensor(v, device=lo.device) for v in args.qrange)
    span = qmax - qmin
    zero_point = None
    if args.symmetric:
        scale = torch.maximum(lo.abs(), hi.abs()) / (span.to(lo.dtype) / 2)
    else:
        scale = (hi - lo) / span.to(hi.dtype)
        zero_point = torch.clamp(qmin - lo / scale, qmin, qmax)
    if global_scale is not None:
        scale = global_scale * scale
    if args.strategy == "tensor_group":
        scale = _round_scale_to_fp8(scale)
        eps = 0.125  # compressed-tensors' floor for e4m3 scales
    else:
        eps = torch.finfo(scale.dtype).eps
    # an all-zero group would divide by zero
    scale = torch.where(scale == 0, torch.tensor(eps, dtype=scale.dtype, device=scale.device), scale)
    if zero_point is not None:
        if args.type == "int":
            zero_point = torch.round(zero_point.clamp(-128, 127)).to(torch.int8)
        else:
            zero_point = zero_point.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        zero_point = zero_point.reshape(1) if zero_point.ndim == 0 else zero_point
    scale = scale.reshape(1) if scale.ndim == 0 else scale
    return scale, zero_point


def compute_qparams(
    x: torch.Tensor, args: QuantArgs, global_scale: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Min-max scale (and zero point, None when symmetric) of ``x`` for ``args``.

    Symmetric: ``amax / ((qmax - qmin) / 2)``, i.e. amax / 7.5 for int4 and / 448 for
    e4m3, so +amax lands on 7.5 and clamps to 7 while -amax reaches -8. Asymmetric:
    ``(max - min) / (qmax - qmin)`` with an int8 (or e4m3) zero point.

    Scale dtype is x's dtype, or fp32 when an fp32 ``global_scale`` is given
    (tensor_group). For tensor_group the scale is e4m3-valued: the local scale times the
    global scale, rounded to e4m3; divide by ``global_scale`` to get the effective scale.
    Without a global scale, tensor_group is group quantization with e4m3-valued scales.
    """
    v = to_granularity(x, args)
    pshape = v.shape[:-1]
    g = None if global_scale is None else _as_param(global_scale, pshape, args, "global_scale")
    if args.symmetric:
        # the scale needs only max |v|, which is max(-min, max, 0): one reduction instead of two
        # (reductions over groups of 16 cost 7x an elementwise pass)
        amax = v.abs().amax(-1)
        return _qparams_from_minmax(-amax, amax, args, g)
    return _qparams_from_minmax(v.amin(-1), v.amax(-1), args, g)


def compute_global_scale(x: torch.Tensor, per_leading: bool = False) -> torch.Tensor:
    """NVFP4 global scale ``448 * 6 / amax(|x|)`` (fp32), so the largest local scale maps to e4m3's max.

    Shape [1]; with ``per_leading`` one per slice of the last two dims, shape
    ``[..., 1, 1]`` (e.g. per expert of an ``[E, N, K]`` weight). Computed in x's dtype,
    as compressed-tensors' ``generate_gparam`` does from x's min and max.
    """
    amax = x.abs().amax(dim=(-2, -1), keepdim=True) if per_leading else x.abs().amax()
    amax = amax.clamp(min=torch.finfo(amax.dtype).tiny)
    g = (FP8_E4M3_MAX * FP4_E2M1_MAX) / amax
    # NaN or an overflow to inf (all-zero tensor): 1 means no global scaling
    g = torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32)
    return g if per_leading else g.reshape(1)


# ---------------------------------------------------------------- QDQ


def _params(x, args, scale, zero_point, global_scale):
    if scale is None:
        if zero_point is not None:
            raise ValueError("a zero_point was given without its scale.")
        scale, zero_point = compute_qparams(x, args, global_scale)
    pshape = _param_shape(x.shape, args)
    scale = _as_param(scale, pshape, args, "scale")
    if zero_point is not None:
        zero_point = _as_param(zero_point, pshape, args, "zero_point")
    if global_scale is not None:
        global_scale = _as_param(global_scale, pshape, args, "global_scale")
    return scale, zero_point, global_scale


def _quantize_view(v, args, scale, zero_point, global_scale):
    if global_scale is not None:
        scale = scale / global_scale
    t = v / scale
    if zero_point is not None:
        t = t + zero_point.to(v.dtype)
    return _round_to_grid(t, args)


def _dequantize_view(q, scale, zero_point, global_scale):
    if global_scale is not None:
        scale = scale / global_scale
    out = q.to(scale.dtype)
    if zero_point is not None:
        out = out - zero_point.to(scale.dtype)
    return out * scale


@torch.no_grad()
def quantize(
    x: torch.Tensor,
    args: QuantArgs,
    scale: Optional[torch.Tensor] = None,
    zero_point: Optional[torch.Tensor] = None,
    global_scale: Optional[torch.Tensor] = None,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Quantized values of ``x`` (on the int / e4m3 / e2m1 grid, zero point included), in ``dtype``
    (default x's dtype, which holds every grid value exactly).

    With ``scale`` None the scales are computed from x (``compute_qparams``): the dynamic
    scales of an activation, or the min-max scales of a weight.
    """
    scale, zero_point, global_scale = _params(x, args, scale, zero_point, global_scale)
    q = _quantize_view(to_granularity(x, args), args, _on_view(scale), _on_view(zero_point), _on_view(global_scale))
    return from_granularity(q, args, x.shape).to(dtype or x.dtype)


@torch.no_grad()
def dequantize(
    q: torch.Tensor,
    args: QuantArgs,
    scale: torch.Tensor,
    zero_point: Optional[torch.Tensor] = None,
    global_scale: Optional[torch.Tensor] = None,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``(q - zero_point) * scale / global_scale``, computed in the (promoted) scale dtype, returned
    in ``dtype`` (default the scale's dtype; fp32 for float8 scales)."""
    out_dtype = dtype or (torch.float32 if scale.dtype in _FP8_DTYPES else scale.dtype)
    scale, zero_point, global_scale = _params(q, args, scale, zero_point, global_scale)
    out = _dequantize_view(to_granularity(q, args), _on_view(scale), _on_view(zero_point), _on_view(global_scale))
    return from_granularity(out, args, q.shape).to(out_dtype)


@torch.no_grad()
def fake_quantize(
    x: torch.Tensor,
    args: QuantArgs,
    scale: Optional[torch.Tensor] = None,
    zero_point: Optional[torch.Tensor] = None,
    global_scale: Optional[torch.Tensor] = None,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``dequantize(quantize(x))``: x as the quantized format represents it, in ``dtype`` (default x's)."""
    scale, zero_point, global_scale = _params(x, args, scale, zero_point, global_scale)
    s, z, g = _on_view(scale), _on_view(zero_point), _on_view(global_scale)
    q = _quantize_view(to_granularity(x, args), args, s, z, g)
    return from_granularity(_dequantize_view(q, s, z, g), args, x.shape).to(dtype or x.dtype)
