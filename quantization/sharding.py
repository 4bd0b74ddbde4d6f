"""Splitting and merging quantized weights across model-parallel ranks.

Weights are quantized whole (as one rank would) and then sliced, so every world size sees the
same numbers. A weight is split along N (its output rows: column-parallel) or K (its inputs:
row-parallel). Packed 4-bit values split along K by whole bytes, and group scales follow their
groups; a split that would cut a byte or a group is an error.
"""

from dataclasses import fields, replace
from typing import Optional

import torch

from kernels.formats import Fp8Weight, Int4Weight, NVFP4Weight, QuantizedWeight, W4A8Weight
from llama_lite.errors import CheckpointError

# field -> (axis when split along N, axis when split along K); None = every rank keeps it whole
_AXES: dict[type, dict[str, tuple[Optional[int], Optional[int]]]] = {
    Int4Weight: {"qweight": (-2, -1), "scales": (-2, -1)},
    Fp8Weight: {"weight": (-2, -1), "scale": (-1, None)},
    W4A8Weight: {"qweight": (-2, -1), "group_scales": (-2, -1), "channel_scales": (-1, None)},
    NVFP4Weight: {"qweight": (-2, -1), "scales": (-2, -1), "global_scale": (None, None),
                  "input_global_scale": (None, None)},
}


def tensor_fields(w: QuantizedWeight) -> dict[str, torch.Tensor]:
    return {f.name: getattr(w, f.name) for f in fields(w) if isinstance(getattr(w, f.name), torch.Tensor)}


def _axis(w: QuantizedWeight, name: str, split: str) -> Optional[int]:
    n_axis, k_axis = _AXES[type(w)][name]
    return n_axis if split == "N" else k_axis


def slice_weight(w: QuantizedWeight, split: str, pieces: int, which: int) -> QuantizedWeight:
    """This rank's part of a whole quantized weight (or of a bf16 one, [..., N, K])."""
    if pieces == 1:
        return w
    if isinstance(w, torch.Tensor):
        axis = -2 if split == "N" else -1
        if w.shape[axis] % pieces:
            raise CheckpointError(f"cannot split a weight of shape {tuple(w.shape)} {pieces} ways along {split}")
        return w.chunk(pieces, dim=axis)[which].contiguous()
    parts = {}
    for name, t in tensor_fields(w).items():
        axis = _axis(w, name, split)
        if axis is None:
            parts[name] = t
            continue
        if t.shape[axis] % pieces:
            raise CheckpointError(
                f"cannot split a {type(w).__name__}.{name} of shape {tuple(t.shape)} {pieces} ways along "
                f"{'K' if split == 'K' else 'N'} without cutting a packed byte or a scale group"
            )
        parts[name] = t.chunk(pieces, dim=axis)[which].contiguous()
    return replace(w, **parts, prepared={})


def merge_weights(shards: list[QuantizedWeight], split: str) -> QuantizedWeight:
    """Concatenate per-rank parts back into the whole weight."""
    first = shards[0]
    if len(shards) == 1:
        return first
    parts = {}
    for name, t in tensor_fields(first).items():
        axis = _axis(first, name, split)
        parts[name] = t if axis is None else torch.cat([getattr(s, name) for s in shards], dim=axis)
    return replace(first, **parts, prepared={})


def stack_experts(experts: list[QuantizedWeight]) -> QuantizedWeight:
    """Experts quantized one at a time ([N, K] each) as one [E, N, K] weight."""
    first = experts[0]
    stacked = {name: torch.stack([getattr(e, name) for e in experts]) for name in tensor_fields(first)}
    return replace(first, **stacked, prepared={})
