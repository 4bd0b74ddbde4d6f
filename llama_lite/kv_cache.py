"""KV caches by layer kind, and what they cost.

Llama 4 interleaves two kinds of attention layers. A chunked (RoPE) layer lets a token at position
p see only the keys of its own chunk, [p - p % C, p], so it needs at most C = attention_chunk_size
positions per row: ``RingCache`` keeps exactly those, in slot p % C. A global (NoPE) layer sees the
whole prefix: ``PrefixCache`` keeps max_seq_len positions and reads only up to the longest filled
row of the batch. The ``full`` layout gives every layer a ``PrefixCache`` (chunked layers masked to
their chunk): what the engine did before, kept as the reference the ring is tested against.

Storage is the activation dtype, bf16, fp32, or fp8 (e4m3) with one fp32 scale per token and KV
head: amax over head_dim maps to 448, so one outlying token or head does not flatten the others.
Attention always sees the stored (rounded) values, in prefill as in decode.
"""

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from .args import ModelArgs
from .errors import ConfigError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# --kv_cache_dtype names; None / "auto" means the model's activation dtype.
KV_CACHE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": FP8}
LAYOUTS = ("by_kind", "full")


def parse_kv_cache_dtype(name, activation_dtype: torch.dtype) -> torch.dtype:
    if name is None or name == "auto":
        return activation_dtype
    if isinstance(name, torch.dtype) and name in KV_CACHE_DTYPES.values():
        return name
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"unknown kv_cache_dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


@dataclass
class Step:
    """What one forward call writes: ``positions`` [B, S] of the new tokens, of which the first
    ``lengths`` [B] per row are real (the rest pads a shorter row and is not stored). Masks are
    built once per step and shared by all layers of a kind."""

    positions: torch.Tensor
    lengths: Optional[torch.Tensor] = None
    masks: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.end = int(self.positions.max()) + 1

    def real(self) -> Optional[torch.Tensor]:
        """[B, S] bool of the tokens to store, or None when all are real."""
        if self.lengths is None:
            return None
        return torch.arange(self.positions.shape[1], device=self.positions.device) < self.lengths.view(-1, 1)


class _Store:
    """[B, slots, H, D] keys and values, in ``dtype`` or as fp8 codes with [B, slots, H] fp32 scales."""

    def __init__(self, batch: int, slots: int, heads: int, head_dim: int, dtype: torch.dtype, device):
        shape = (batch, slots, heads, head_dim)
        self.fp8 = dtype == FP8
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # without fp8, empty stand-ins: ``decode_attention`` always takes four tensors
        scale_shape = shape[:-1] if self.fp8 else (0,)
        self.k_scale = torch.zeros(scale_shape, dtype=torch.float32, device=device)
        self.v_scale = torch.zeros(scale_shape, dtype=torch.float32, device=device)

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> "_Store":
        """A store over existing tensors (no copy)."""
        store = cls.__new__(cls)
        store.k, store.v, store.k_scale, store.v_scale = k, v, k_scale, v_scale
        store.fp8 = k.dtype == FP8
        return store

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.k, self.v, self.k_scale, self.v_scale

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @staticmethod
    def _quantize(x: torch.Tensor):
        xf = x.float()
        scale = xf.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
        return (xf / scale.unsqueeze(-1)).to(FP8), scale

    def write(self, index: tuple, k: torch.Tensor, v: torch.Tensor) -> None:
        """``index`` selects [..., H, D] entries of the [B, slots] grid (advanced indexing)."""
        if self.fp8:
            self.k[index], self.k_scale[index] = self._quantize(k)
            self.v[index], self.v_scale[index] = self._quantize(v)
        else:
            self.k[index], self.v[index] = k.to(self.k.dtype), v.to(self.v.dtype)

    def read(self, bsz: int, n: int, dtype: torch.dtype):
        """Keys and values of slots [0, n) of rows [0, bsz), [B, n, H, D] in ``dtype`` (views when not fp8)."""
        if not self.fp8:
            return self.k[:bsz, :n].to(dtype), self.v[:bsz, :n].to(dtype)
        k = self.k[:bsz, :n].float() * self.k_scale[:bsz, :n, :, None]
        v = self.v[:bsz, :n].float() * self.v_scale[:bsz, :n, :, None]
        return k.to(dtype), v.to(dtype)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """x as it would read back from the store."""
        if self.fp8:
            codes, scale = self._quantize(x)
            return (codes.float() * scale.unsqueeze(-1)).to(x.dtype)
        return x.to(self.k.dtype).to(x.dtype)


def _write_one(store: _Store, k: torch.Tensor, v: torch.Tensor, pos_b1: torch.Tensor, chunk: int, ring: bool,
               every_slot: bool = False) -> tuple[int, torch.Tensor]:
    """Store one new token per row at positions ``pos_b1`` [B, 1] (slot p % chunk of a ring, else
    slot p) and give (n, mask [B, 1, 1, n]) of the slots [0, n) it attends to: up to the furthest
    row's slot (all of them with ``every_slot``), causal, and within the query's chunk when
    ``chunk`` > 0 on a prefix cache."""
    bsz, dev = pos_b1.shape[0], pos_b1.device
    slot = pos_b1 % chunk if ring else pos_b1
    store.write((torch.arange(bsz, device=dev).unsqueeze(1), slot), k, v)
    n = store.k.shape[1] if every_slot else int(slot.max()) + 1
    key_pos = torch.arange(n, device=dev)
    mask = key_pos <= slot
    if chunk and not ring:
        mask &= key_pos // chunk == pos_b1 // chunk
    return n, mask.view(bsz, 1, 1, n)


def attend_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, 1, H, D] over keys / values [B, n, Hkv, D] where mask [B, 1, 1, n] allows: [B, 1, H, D]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


# Implementations of a decode step's attention, by number: (attend, step), where ``attend`` takes
# ``attend_sdpa``'s arguments and ``step``, if not None, does the whole step (write and attend) with
# ``decode_attention_eager``'s arguments less ``impl``, or returns None where it does not apply. A
# loader may add faster ones for its device and point layers at them (``Attention.attend_impl``).
# A number, not a function, because it passes through a custom op.
_ATTEND: list = [(attend_sdpa, None)]


def register_attention(fn, step=None) -> int:
    """The number by which ``Attention.attend_impl`` selects ``fn`` (and ``step``, see ``_ATTEND``);
    the same number for the same pair."""
    if (fn, step) not in _ATTEND:
        _ATTEND.append((fn, step))
    return _ATTEND.index((fn, step))


def decode_attention(q, k, v, cache_k, cache_v, k_scale, v_scale, positions, chunk: int, ring: bool, impl: int = 0):
    """``decode_attention_op`` while torch.compile traces, its function directly otherwise."""
    fn = decode_attention_op if torch.compiler.is_compiling() else decode_attention_eager
    return fn(q, k, v, cache_k, cache_v, k_scale, v_scale, positions, chunk, ring, impl)


def decode_attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                           cache_v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                           positions: torch.Tensor, chunk: int, ring: bool, impl: int = 0) -> torch.Tensor:
    """One decode step of one attention layer: q [B, 1, H, D], k / v [B, 1, Hkv, D] at ``positions`` [B].

    Writes k / v into the cache (slot p % chunk of a ring, else slot p), then attends over the
    filled part: a ring's slots up to the furthest row's, a prefix cache's positions up to the
    furthest row's, masked per row (causal, and within the query's chunk when ``chunk`` > 0 on a
    prefix cache). Returns [B, 1, H, D]. An operator of its own: on a CPU the attended length
    depends on the positions, so a compiled decode step keeps fixed shapes around it. ``impl``:
    which implementation attends (``register_attention``; 0 is PyTorch's SDPA).
    """
    attend, whole_step = _ATTEND[impl]
    if whole_step is not None:
        out = whole_step(q, k, v, cache_k, cache_v, k_scale, v_scale, positions, chunk, ring)
        if out is not None:
            return out
    store = _Store.of(cache_k, cache_v, k_scale, v_scale)
    bsz = q.shape[0]
    # On a GPU every slot, masked: no host sync, so a CUDA graph can hold the step.
    n, mask = _write_one(store, k, v, positions.view(bsz, 1), chunk, ring, every_slot=q.is_cuda)
    keys, values = store.read(bsz, n, q.dtype)
    return attend(q, keys, values, mask)


decode_attention_op = torch.library.custom_op(
    "llama_lite::decode_attention", decode_attention_eager, mutates_args=("cache_k", "cache_v", "k_scale", "v_scale"))


@decode_attention_op.register_fake
def _(q, k, v, cache_k, cache_v, k_scale, v_scale, positions, chunk, ring, impl=0):
    return torch.empty_like(q)


class PrefixCache:
    """max_seq_len positions per row. Writes the new tokens, then attends over positions [0, end)
    of the batch (end: one past the furthest new token), causally, and within the query's chunk
    when ``chunk`` is set (the full layout's chunked layers)."""

    def __init__(self, batch: int, max_seq_len: int, heads: int, head_dim: int, dtype, device,
                 chunk: Optional[int] = None):
        self.store = _Store(batch, max_seq_len, heads, head_dim, dtype, device)
        self.chunk = chunk

    def update(self, k: torch.Tensor, v: torch.Tensor, step: Step):
        bsz = k.shape[0]
        real = step.real()
        if real is None:
            rows = torch.arange(bsz, device=k.device).unsqueeze(1)
            self.store.write((rows, step.positions), k, v)
        else:
            b, j = real.nonzero(as_tuple=True)
            self.store.write((b, step.positions[b, j]), k[b, j], v[b, j])
        keys, values = self.store.read(bsz, step.end, k.dtype)
        key = ("prefix", self.chunk)
        if key not in step.masks:
            key_pos = torch.arange(step.end, device=k.device)
            q = step.positions.unsqueeze(-1)
            mask = key_pos <= q
            if self.chunk:
                mask &= key_pos // self.chunk == q // self.chunk
            step.masks[key] = mask.unsqueeze(1)
        return keys, values, step.masks[key]

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               impl: int = 0) -> torch.Tensor:
        """Attention output [B, 1, H, D] of one new token per row at ``positions`` [B] (see ``decode_attention``)."""
        return decode_attention(q, k, v, *self.store.tensors(), positions, self.chunk or 0, False, impl)


class RingCache:
    """The last ``chunk`` positions per row, position p in slot p % chunk: all that a chunked layer
    can see. Decode reads the row's filled part of its chunk; a prefill reads the part of its first
    chunk already cached, attends over that plus the new tokens, and stores only the new tokens
    that later ones can see (each row's last ``chunk``)."""

    def __init__(self, batch: int, max_seq_len: int, heads: int, head_dim: int, dtype, device, chunk: int):
        self.chunk = chunk
        self.store = _Store(batch, min(chunk, max_seq_len), heads, head_dim, dtype, device)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               impl: int = 0) -> torch.Tensor:
        """Attention output [B, 1, H, D] of one new token per row at ``positions`` [B] (see ``decode_attention``)."""
        return decode_attention(q, k, v, *self.store.tensors(), positions, self.chunk, True, impl)

    def update(self, k: torch.Tensor, v: torch.Tensor, step: Step):
        bsz, seqlen = k.shape[:2]
        c, pos = self.chunk, step.positions
        dev = k.device
        masks = step.masks
        if seqlen == 1:
            n, mask = _write_one(self.store, k, v, pos, c, True)
            keys, values = self.store.read(bsz, n, k.dtype)
            return keys, values, mask

        start = pos[:, 0]
        if ("ring", c) not in masks:
            n = int((start % c).max())  # cached slots of the first chunk that any row still sees
            same_chunk = (pos // c == (start // c).view(-1, 1)).view(bsz, 1, seqlen, 1)
            cached = (torch.arange(n, device=dev) < (start % c).view(-1, 1)).view(bsz, 1, 1, n) & same_chunk
            new = (pos.unsqueeze(-1) >= pos.unsqueeze(1)) & (pos.unsqueeze(-1) // c == pos.unsqueeze(1) // c)
            masks["ring", c] = torch.cat([cached, new.unsqueeze(1)], dim=-1)
        mask = masks["ring", c]
        old_k, old_v = self.store.read(bsz, mask.shape[-1] - seqlen, k.dtype)
        # cat copies the cached part before the writes below replace it
        keys = torch.cat([old_k, self.store.round_trip(k)], dim=1)
        values = torch.cat([old_v, self.store.round_trip(v)], dim=1)
        lengths = step.lengths if step.lengths is not None else torch.full((bsz,), seqlen, device=dev)
        j = torch.arange(seqlen, device=dev)
        keep = (j < lengths.view(-1, 1)) & (j >= lengths.view(-1, 1) - c)
        b, jj = keep.nonzero(as_tuple=True)
        self.store.write((b, pos[b, jj] % c), k[b, jj], v[b, jj])
        return keys, values, mask


def make_cache(layout: str, chunk: Optional[int], batch: int, max_seq_len: int, heads: int, head_dim: int,
               dtype: torch.dtype, device):
    """The cache of one attention layer: ``chunk`` is the layer's attention chunk (None: global)."""
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown KV cache layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if layout == "by_kind" and chunk:
        return RingCache(batch, max_seq_len, heads, head_dim, dtype, device, chunk)
    return PrefixCache(batch, max_seq_len, heads, head_dim, dtype, device, chunk)


def kv_cache_bytes(args: ModelArgs, max_seq_len: int, max_batch_size: int, dtype: torch.dtype,
                   layout: str = "by_kind", world_size: int = 1) -> int:
    """Bytes of one rank's KV caches for ``max_seq_len`` x ``max_batch_size`` (what setup_caches allocates)."""
    heads = args.n_kv_heads // world_size
    per_slot = heads * (args.head_dim * torch.empty((), dtype=dtype).element_size() + (4 if dtype == FP8 else 0))
    slots = 0
    for i in range(args.n_layers):
        chunked = args.attention_chunk_size and not args.is_nope_layer(i)
        slots += min(args.attention_chunk_size, max_seq_len) if chunked and layout == "by_kind" else max_seq_len
    return 2 * max_batch_size * slots * per_slot


def largest_fitting_seq_len(args: ModelArgs, budget: int, max_batch_size: int, dtype: torch.dtype,
                            layout: str = "by_kind", world_size: int = 1) -> int:
    """The largest max_seq_len whose KV cache takes at most ``budget`` bytes (0 if not even 1)."""
    lo, hi = 0, 1
    while kv_cache_bytes(args, hi, max_batch_size, dtype, layout, world_size) <= budget:
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if kv_cache_bytes(args, mid, max_batch_size, dtype, layout, world_size) <= budget:
            lo = mid
        else:
            hi = mid
    return lo
