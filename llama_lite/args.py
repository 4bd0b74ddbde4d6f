"""Model hyper-parameters, read from Meta's params.json or Hugging Face's config.json."""

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from .errors import ConfigError


@dataclass
class MoEArgs:
    num_experts: int = -1
    capacity_factor: float = 1.0
    auto_scale_F: bool = True  # noqa: N815 - Meta's name
    top_k: int = 1
    interleave_moe_layer_step: int = 1


@dataclass
class VisionArgs:
    """The vision tower (encoder, pixel shuffle adapter); tiles and patches are square."""

    image_size: int = -1  # side of one tile in pixels
    patch_size: int = -1
    dim: int = -1
    n_layers: int = -1
    n_heads: int = -1
    mlp_ratio: float = 4.0
    output_dim: int = -1  # width of the adapter's output, the input of the projection into the text model
    pixel_shuffle_ratio: float = 0.5
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        # Meta writes sizes as {"height": h, "width": w}.
        for name in ("image_size", "patch_size"):
            value = getattr(self, name)
            if isinstance(value, dict):
                if set(value) != {"height", "width"} or value["height"] != value["width"]:
                    raise ConfigError(f"vision '{name}' must be square ({{'height': n, 'width': n}}), got {value!r}")
                setattr(self, name, value["height"])
        for name in ("image_size", "patch_size", "dim", "n_layers", "n_heads", "output_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"vision parameter '{name}' must be a positive integer, got {value!r}")
        if self.image_size % self.patch_size:
            raise ConfigError(f"vision image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 4:
            raise ConfigError(f"vision dim {self.dim} must split into {self.n_heads} heads of a multiple of 4")
        ratio = self.pixel_shuffle_ratio
        side = self.image_size // self.patch_size
        if not isinstance(ratio, (int, float)) or not 0 < ratio <= 1 or (side * ratio) % 1 or (self.dim / ratio**2) % 1:
            raise ConfigError(f"vision pixel_shuffle_ratio {ratio!r} does not divide the {side}x{side} patch grid")

    @property
    def patches_per_tile(self) -> int:
        """Embeddings (and ``<|patch|>`` tokens) one tile yields after pixel shuffle."""
        side = self.image_size // self.patch_size
        return side * side // int(round(1.0 / self.pixel_shuffle_ratio**2))

    def to_params(self) -> dict[str, Any]:
        """The params.json form: Meta's keys, plus rope_theta / norm_eps where they differ from Meta's fixed values."""
        out = {k: v for k, v in vars(self).items() if (k, v) not in (("rope_theta", 10000.0), ("norm_eps", 1e-5))}
        for name in ("image_size", "patch_size"):
            out[name] = {"height": out[name], "width": out[name]}
        return out


@dataclass
class ModelArgs:
    dim: int = -1
    n_layers: int = -1
    n_heads: int = -1
    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    vocab_size: int = -1
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    ffn_exp: Optional[float] = None
    norm_eps: float = 1e-5
    attention_chunk_size: Optional[int] = None
    rope_theta: float = 500000.0
    use_scaled_rope: bool = False
    rope_scaling_factor: Optional[float] = None
    rope_high_freq_factor: Optional[float] = None
    nope_layer_interval: Optional[int] = None
    use_qk_norm: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    moe_args: Optional[MoEArgs] = None
    vision_args: Optional[VisionArgs] = None
    # Explicit hidden sizes (Hugging Face configs state them); None = Meta's sizing rules.
    ffn_hidden_dim: Optional[int] = None
    moe_hidden_dim: Optional[int] = None
    max_batch_size: int = 32
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        if isinstance(self.moe_args, dict):
            self.moe_args = _build(MoEArgs, self.moe_args, "moe_args")
        if isinstance(self.vision_args, dict):
            self.vision_args = _build(VisionArgs, self.vision_args, "vision_args")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "max_batch_size", "max_seq_len", "multiple_of"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model parameter '{name}' must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ConfigError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
            self.head_dim = self.dim // self.n_heads
        if self.head_dim % 2:
            raise ConfigError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.use_scaled_rope:
            # Only Scout ships scaled RoPE, and its params.json leaves these to the code.
            self.rope_scaling_factor = self.rope_scaling_factor or 16.0
            self.rope_high_freq_factor = self.rope_high_freq_factor or 1.0
        if self.attention_chunk_size is not None and self.attention_chunk_size <= 0:
            raise ConfigError(f"attention_chunk_size must be positive, got {self.attention_chunk_size}")
        if self.moe_args is not None:
            m = self.moe_args
            if m.num_experts <= 0 or not 1 <= m.top_k <= m.num_experts or m.interleave_moe_layer_step <= 0:
                raise ConfigError(
                    f"moe_args are inconsistent (num_experts={m.num_experts}, top_k={m.top_k}, "
                    f"interleave_moe_layer_step={m.interleave_moe_layer_step})"
                )
            if self.moe_hidden_dim is None and self.ffn_exp is None:
                raise ConfigError("a MoE model needs 'ffn_exp' (or an explicit expert hidden size) in its config")

    # --- layer layout -------------------------------------------------------------------
    def is_nope_layer(self, layer_id: int) -> bool:
        return self.nope_layer_interval is not None and (layer_id + 1) % self.nope_layer_interval == 0

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe_args is not None and (layer_id + 1) % self.moe_args.interleave_moe_layer_step == 0

    def dense_hidden_dim(self) -> int:
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def expert_hidden_dim(self) -> int:
        """Meta's rule: 2/3 of ffn_exp * dim, times the multiplier, optionally / (capacity + 1), rounded up."""
        if self.moe_hidden_dim is not None:
            return self.moe_hidden_dim
        assert self.moe_args is not None and self.ffn_exp is not None
        hidden = int(2 * int(self.ffn_exp * self.dim) / 3)
        hidden = int((self.ffn_dim_multiplier or 1.0) * hidden)
        if self.moe_args.auto_scale_F:
            hidden = int(hidden / (self.moe_args.capacity_factor + 1))
        return hidden + (-hidden % self.multiple_of)

    def to_params(self) -> dict[str, Any]:
        """The params.json form (Meta layout) of these arguments."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("max_batch_size", "max_seq_len")}
        out["moe_args"] = None if self.moe_args is None else dict(vars(self.moe_args))
        out["vision_args"] = None if self.vision_args is None else self.vision_args.to_params()
        return {k: v for k, v in out.items() if v is not None}


# Keys of Meta's params.json that describe parts this engine does not run or runtime limits.
_IGNORED_PARAMS = {"quantization_args", "lora_args", "max_batch_size", "max_seq_len"}


def _build(cls, values: dict, where: str):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)} in {where}")
    try:
        return cls(**values)
    except TypeError as e:  # wrong types that dataclass construction trips on
        raise ConfigError(f"invalid {where}: {e}") from None


def _check_types(values: dict, where: str) -> None:
    numeric = {"dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "multiple_of",
               "ffn_dim_multiplier", "ffn_exp", "norm_eps", "attention_chunk_size", "rope_theta",
               "rope_scaling_factor", "rope_high_freq_factor", "nope_layer_interval", "floor_scale", "attn_scale",
               "ffn_hidden_dim", "moe_hidden_dim"}
    for k, v in values.items():
        if k in numeric and v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ConfigError(f"'{k}' in {where} must be a number, got {v!r}")
        if k in {"dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "multiple_of",
                 "attention_chunk_size", "nope_layer_interval"} and v is not None and not isinstance(v, int):
            raise ConfigError(f"'{k}' in {where} must be an integer, got {v!r}")


def args_from_params(params: dict, **overrides: Any) -> ModelArgs:
    """ModelArgs from the contents of Meta's params.json."""
    if not isinstance(params, dict):
        raise ConfigError("params.json must hold a JSON object")
    values = {k: v for k, v in params.items() if k not in _IGNORED_PARAMS}
    _check_types(values, "params.json")
    moe = values.pop("moe_args", None)
    if moe is not None and not isinstance(moe, dict):
        raise ConfigError("'moe_args' in params.json must be an object")
    vision = values.get("vision_args")
    if vision is not None:
        if not isinstance(vision, dict):
            raise ConfigError("'vision_args' in params.json must be an object")
        values["vision_args"] = _build(VisionArgs, vision, "params.json vision_args")
    args = _build(ModelArgs, {**values, **overrides}, "params.json")
    if moe is not None:
        args.moe_args = _build(MoEArgs, moe, "params.json moe_args")
        args.__post_init__()
    return args


def _periodic_interval(flags: list[bool], what: str) -> Optional[int]:
    """Smallest n with flags[i] == ((i + 1) % n == 0) for all i, or None when no layer is flagged."""
    if not any(flags):
        return None
    n = flags.index(True) + 1
    if any(flag != ((i + 1) % n == 0) for i, flag in enumerate(flags)):
        raise ConfigError(f"{what} must repeat every n layers (as Llama 4 does); got {flags}")
    return n


def args_from_hf_config(config: dict, **overrides: Any) -> ModelArgs:
    """ModelArgs from a Hugging Face config.json (Llama4ForCausalLM, or the text part of the multimodal model)."""
    if not isinstance(config, dict):
        raise ConfigError("config.json must hold a JSON object")
    c = config.get("text_config", config)
    try:
        n_layers = c["num_hidden_layers"]
        no_rope = c.get("no_rope_layers") or [1] * n_layers
        moe_layers = c.get("moe_layers")
        if moe_layers is None:
            step = c.get("interleave_moe_layer_step", 1)
            moe_layers = [i for i in range(n_layers) if (i + 1) % step == 0] if step else []
        moe_flags = [i in set(moe_layers) for i in range(n_layers)]
        rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
        scaled = rope.get("rope_type") == "llama3"
        values = dict(
            dim=c["hidden_size"],
            n_layers=n_layers,
            n_heads=c["num_attention_heads"],
            n_kv_heads=c.get("num_key_value_heads"),
            head_dim=c.get("head_dim"),
            vocab_size=c["vocab_size"],
            norm_eps=c.get("rms_norm_eps", 1e-5),
            attention_chunk_size=c.get("attention_chunk_size"),
            rope_theta=c.get("rope_theta", rope.get("rope_theta", 500000.0)),
            use_scaled_rope=scaled,
            rope_scaling_factor=rope.get("factor") if scaled else None,
            rope_high_freq_factor=rope.get("high_freq_factor") if scaled else None,
            nope_layer_interval=_periodic_interval([not r for r in no_rope], "no_rope_layers"),
            use_qk_norm=bool(c.get("use_qk_norm", False)),
            attn_temperature_tuning=bool(c.get("attn_temperature_tuning", False)),
            floor_scale=float(c.get("floor_scale", 8192.0)),
            attn_scale=float(c.get("attn_scale", 0.1)),
            ffn_hidden_dim=c.get("intermediate_size_mlp"),
            moe_hidden_dim=c.get("intermediate_size"),
        )
        interval = _periodic_interval(moe_flags, "moe_layers")
        if interval is not None:
            values["moe_args"] = MoEArgs(
                num_experts=c["num_local_experts"], top_k=c.get("num_experts_per_tok", 1),
                interleave_moe_layer_step=interval,
            )
    except KeyError as e:
        raise ConfigError(f"config.json lacks the key {e.args[0]!r}") from None
    _check_types(values, "config.json")
    if config.get("vision_config") is not None:
        values["vision_args"] = vision_args_from_hf_config(config["vision_config"])
    return _build(ModelArgs, {**values, **overrides}, "config.json")


def vision_args_from_hf_config(v: dict) -> VisionArgs:
    """VisionArgs from the vision_config of a Llama4ForConditionalGeneration config (transformers' defaults
    for the keys it leaves out, as transformers itself reads it)."""
    if not isinstance(v, dict):
        raise ConfigError("'vision_config' in config.json must be an object")
    dim, heads = v.get("hidden_size", 768), v.get("num_attention_heads", 16)
    hidden = v.get("intermediate_size", 5632)
    out = v.get("projector_output_dim", 4096)
    out_dims = {v.get("projector_input_dim", 4096), out, v.get("vision_output_dim", out)}
    if len(out_dims) != 1:
        raise ConfigError("vision_config's projector_input_dim, projector_output_dim and vision_output_dim must be equal")
    rope = v.get("rope_parameters") or v.get("rope_scaling") or {}
    args = _build(VisionArgs, dict(
        image_size=v.get("image_size", 448), patch_size=v.get("patch_size", 14), dim=dim,
        n_layers=v.get("num_hidden_layers", 34), n_heads=heads,
        mlp_ratio=hidden / dim if isinstance(dim, int) and dim > 0 and isinstance(hidden, (int, float)) else -1.0,
        output_dim=out_dims.pop(), pixel_shuffle_ratio=v.get("pixel_shuffle_ratio", 0.5),
        rope_theta=rope.get("rope_theta", v.get("rope_theta", 10000.0)), norm_eps=v.get("norm_eps", 1e-5),
    ), "config.json vision_config")
    # transformers sizes the encoder's MLP and the adapter's input both by intermediate_size.
    if int(args.mlp_ratio * args.dim) != hidden or int(args.dim / args.pixel_shuffle_ratio**2) != hidden:
        raise ConfigError(f"vision_config's intermediate_size {hidden} must equal hidden_size / pixel_shuffle_ratio**2")
    return args


def read_json(path: Path) -> dict:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
