"""This package's own pre-quantized checkpoint format, and reading llama-models' one.

Ours: one folder with, per model-parallel rank, ``model.NN.safetensors`` holding real dtypes
(packed uint8 4-bit values, float8_e4m3fn scales, fp32 scales, bf16 for what stays unquantized),
plus ``quantization.json``::

    {"format_version": 1, "quantization_mode": "int4_mixed", "mp": 2, "group_size": 128,
     "targets": ["experts", "shared_expert"],
     "tensors": {"layers.0.feed_forward.experts.w1": {"format": "int4", "split": "N", "group_size": 128}, ...}}

A quantized weight named W is stored as W.<field> (e.g. W.qweight, W.scales). Tensor names are
the engine's parameter names; quantized expert weights are in nn.Linear orientation [E, N, K].
"""

import json
import re
from dataclasses import fields
from pathlib import Path
from typing import Optional

import torch

from kernels.formats import Fp8Weight, Int4Weight, NVFP4Weight, QuantizedWeight, W4A8Weight
from llama_lite.checkpoint import load_pth, release_file_pages, split_axis
from llama_lite.errors import CheckpointError

from .sharding import merge_weights, tensor_fields

FORMAT_VERSION = 1
QUANT_CONFIG = "quantization.json"
FORMAT_CLASSES: dict[str, type] = {"int4": Int4Weight, "fp8": Fp8Weight, "w4a8": W4A8Weight, "nvfp4": NVFP4Weight}
CLASS_FORMATS = {cls: name for name, cls in FORMAT_CLASSES.items()}
_SHARD_RE = re.compile(r"^model\.(\d+)\.safetensors$")


def weight_meta(w: QuantizedWeight, split: str) -> dict:
    """The JSON entry of a quantized weight: its format, split axis and non-tensor fields."""
    meta = {"format": CLASS_FORMATS[type(w)], "split": split}
    for f in fields(w):
        value = getattr(w, f.name)
        if f.name != "prepared" and not isinstance(value, torch.Tensor) and value is not None:
            meta[f.name] = value
    return meta


def read_quant_config(ckpt_dir: Path) -> Optional[dict]:
    path = Path(ckpt_dir) / QUANT_CONFIG
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("tensors"), dict):
        raise CheckpointError(f"{path} is not a llama-lite quantization config")
    version = cfg.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {version!r}, newer than this llama-lite understands ({FORMAT_VERSION}); upgrade llama-lite"
        )
    return cfg


class QuantizedCheckpoint:
    """Reads our format: whole tensors, merged from however many rank files were written."""

    def __init__(self, ckpt_dir: Path, cfg: dict):
        from safetensors import SafetensorError, safe_open

        self.dir, self.cfg = Path(ckpt_dir), cfg
        self.mode = cfg.get("quantization_mode")
        self.targets = tuple(cfg.get("targets", ()))
        self.tensors: dict[str, dict] = cfg["tensors"]
        files = sorted(p for p in self.dir.glob("model.*.safetensors") if _SHARD_RE.match(p.name))
        numbers = [int(_SHARD_RE.match(p.name).group(1)) for p in files]
        mp = cfg.get("mp", len(files))
        if numbers != list(range(mp)):
            missing = sorted(set(range(mp)) - set(numbers))
            raise CheckpointError(
                f"{self.dir} should hold {mp} files model.00..{mp - 1:02d}.safetensors"
                + (f" but lacks model.{missing[0]:02d}.safetensors" if missing else f" but holds {len(files)}")
            )
        self.files = files
        self.handles = []
        for p in files:
            try:
                self.handles.append(safe_open(str(p), framework="pt"))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot read {p}: corrupted safetensors file ({e})") from None
        self.names = set(self.handles[0].keys())

    def release(self, within: Optional[tuple[int, int]] = None) -> None:
        release_file_pages(self.files, within)

    def _parts(self, name: str) -> list[torch.Tensor]:
        if name not in self.names:
            raise CheckpointError(f"{self.dir} lacks the tensor {name!r}")
        try:
            return [h.get_tensor(name) for h in self.handles]
        except Exception as e:  # safetensors raises its own error types for truncated data
            raise CheckpointError(f"cannot read tensor {name!r} from {self.dir}: {e}") from None

    def is_quantized(self, name: str) -> bool:
        return name in self.tensors

    def quantized(self, name: str) -> QuantizedWeight:
        meta = dict(self.tensors[name])
        cls = FORMAT_CLASSES.get(meta.pop("format", None))
        if cls is None:
            raise CheckpointError(f"unknown format for {name!r} in {QUANT_CONFIG}")
        split = meta.pop("split")
        tensor_names = [f.name for f in fields(cls) if f.name != "prepared" and f.name not in meta]
        shards = []
        for i in range(len(self.handles)):
            kwargs = dict(meta)
            for field_name in tensor_names:
                key = f"{name}.{field_name}"
                if key in self.names:
                    kwargs[field_name] = self.handles[i].get_tensor(key)
            try:
                shards.append(cls(**kwargs))
            except TypeError:
                raise CheckpointError(f"{self.dir} lacks scales or values of {name!r}") from None
        return merge_weights(shards, split)

    def bf16(self, name: str) -> torch.Tensor:
        parts = self._parts(name)
        axis = split_axis(name)
        return parts[0] if axis is None or len(parts) == 1 else torch.cat(parts, dim=axis)


def save_rank_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def flatten_weight(name: str, w: QuantizedWeight) -> dict[str, torch.Tensor]:
    return {f"{name}.{k}": v for k, v in tensor_fields(w).items()}


# --- llama-models' pre-quantized layout ------------------------------------------------------
# Its quantize script stores routed experts packed (two int4 per byte, low nibble first) and
# viewed as float8_e4m3fn, transposed back to the [E, D, F] layout, with scales in separate
# int4_scales_N.pt ([E, K/128, N]) or fp8_scales_N.pt ([E, N]) files keyed by the engine names.


def llama_models_scale_files(ckpt_dir: Path, mode: str) -> list[Path]:
    prefix = {"int4_mixed": "int4_scales", "fp8_mixed": "fp8_scales"}.get(mode)
    other = [p.name for p in Path(ckpt_dir).glob("*_scales_*.pt")]
    if prefix is None:
        if other:
            raise CheckpointError(
                f"{ckpt_dir} holds llama-models scales ({other[0]}); load it with int4_mixed or fp8_mixed"
            )
        return []
    files = sorted(Path(ckpt_dir).glob(f"{prefix}_*.pt"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    if not files and other:
        wanted = "int4_mixed" if other[0].startswith("int4") else "fp8_mixed"
        raise CheckpointError(f"{ckpt_dir} was quantized by llama-models as {wanted}, not {mode}")
    return files


def llama_models_expert(
    packed_full: torch.Tensor, scales: list[torch.Tensor], mode: str, which: str, group_size: int = 128
) -> QuantizedWeight:
    """One routed-expert weight from llama-models' layout -> our container (nn.Linear orientation).

    packed_full: the whole tensor as the core reads it, [E, D/2, F] (w1/w3) or [E, F/2, D] (w2)
    for int4, [E, D, F] / [E, F, D] for fp8. scales: one per source rank.
    """
    if mode == "int4_mixed":
        q = packed_full.view(torch.uint8).transpose(1, 2).contiguous()  # [E, N, K/2]
        axis = 2 if which in ("w1", "w3") else 1  # N is split for w1/w3, K for w2
        s = torch.cat(scales, dim=axis) if len(scales) > 1 else scales[0]  # [E, K/g, N]
        return Int4Weight(qweight=q, scales=s.transpose(1, 2).contiguous().float(), group_size=group_size)
    w = packed_full.view(torch.float8_e4m3fn).transpose(1, 2).contiguous()  # [E, N, K]
    e, n = w.shape[0], w.shape[1]
    if which in ("w1", "w3") or len(scales) == 1:
        s = torch.cat([x.float().reshape(e, -1) for x in scales], dim=-1)
        return Fp8Weight(weight=w, scale=s.reshape(e, n))
    # w2 was split along K when written, and each rank scaled its rows by its own slice's
    # maximum: one scale per row cannot hold that, so the whole rows are quantized again.
    from .formats import quantize_fp8_rowwise

    pieces = w.float().chunk(len(scales), dim=-1)
    deq = torch.cat([p * s.float().reshape(e, n, 1) for p, s in zip(pieces, scales)], dim=-1)
    return quantize_fp8_rowwise(deq)


def load_llama_models_scales(files: list[Path]) -> list[dict]:
    return [load_pth(p, mmap=False) for p in files]
