"""Reading checkpoints: Meta's layout (params.json + consolidated.NN.pth, any model-parallel size)
and Hugging Face's (config.json + *.safetensors). Nothing here executes pickled code.

A ``Checkpoint`` is a lazy view for one model-parallel rank of the run: ``get(name)`` returns the
tensor this rank needs under the engine's parameter name, resharded from whatever MP size the
files were written with. All renaming of Meta's fused keys and Hugging Face's names lives here.
"""

import ctypes
import json
import mmap
import os
import pickle
import re
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from .args import ModelArgs, args_from_hf_config, args_from_params, read_json
from .errors import CheckpointError, ConfigError

_SHARD_RE = re.compile(r"consolidated\.(\d+)\.pth$")

# How a parameter is split across model-parallel ranks: the axis, or None when every rank holds it whole.
_SPLIT_RULES: list[tuple[re.Pattern, Optional[int]]] = [
    (re.compile(p), axis)
    for p, axis in [
        # The vision tower (Meta's names): attention and MLPs as in the text model, biases with their
        # output rows; row-parallel biases, norms and embeddings whole.
        (r"^vision_embeddings\..*\.(wo|c_proj)\.bias$", None),
        (r"^vision_embeddings\..*\.(w[qkv]|c_fc|_linear)\.(weight|bias)$", 0),
        (r"^vision_embeddings\..*\.(wo|c_proj)\.weight$", 1),
        (r"^vision_embeddings\..*(ln_\w+\.(weight|bias)|class_embedding|positional_embedding_vlm)$", None),
        (r"^vision_projection\.weight$", 0),
        (r"^tok_embeddings\.weight$", 0),
        (r"^output\.weight$", 0),
        (r"\.attention\.w[qkv]\.weight$", 0),
        (r"\.attention\.wo\.weight$", 1),
        (r"\.feed_forward\.(shared_expert\.)?w[13]\.weight$", 0),
        (r"\.feed_forward\.(shared_expert\.)?w2\.weight$", 1),
        (r"\.feed_forward\.experts\.w[13]$", 2),
        (r"\.feed_forward\.experts\.w2$", 1),
        (r"norm\.weight$", None),
        (r"\.feed_forward\.router_DE$", None),
    ]
]


def split_axis(name: str) -> Optional[int]:
    """Axis along which ``name`` is sharded under tensor parallelism (None: replicated)."""
    for pattern, axis in _SPLIT_RULES:
        if pattern.search(name):
            return axis
    raise CheckpointError(f"no sharding rule for parameter {name!r}")


def load_pth(path: Path, mmap: bool = True) -> dict:
    """torch.load with weights_only=True: a file that needs arbitrary code to unpickle is refused."""
    try:
        obj = torch.load(str(path), map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message is a page of advice; the one fact worth a sentence is what the file would run.
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f"unpickling it would call {found.group(1)}" if found else "it holds objects other than tensors"
        raise CheckpointError(f"refused to load {path}: {what}, and only plain tensor files are loaded") from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        detail = str(e).split(". ")[0].strip()
        raise CheckpointError(f"cannot read {path}: it is truncated or not a PyTorch checkpoint ({detail})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} does not hold a state dict")
    return obj


_MADV_DONTNEED = 4


def release_file_pages(paths, within: Optional[tuple[int, int]] = None) -> int:
    """Drop this process's resident pages of the memory-mapped ``paths``; returns the bytes advised.
    ``within`` (start, end) addresses: only the whole pages of the mappings inside that range.

    Weights are mapped read-only in effect (never written), so the pages stay in the page cache
    and a later access simply maps them again: this only lowers the resident set while a loader
    walks a large file once. A no-op where /proc/self/maps or madvise is not available.
    """
    names = {str(Path(p).resolve()) for p in paths}
    if not names or not os.path.exists("/proc/self/maps"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return 0
    done = 0
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[5].strip() not in names:
            continue
        start, end = (int(v, 16) for v in fields[0].split("-"))
        if within is not None:  # mappings start on a page; keep to the whole pages inside the range
            page = mmap.PAGESIZE
            start = max(start, -(-within[0] // page) * page)
            end = min(end, within[1] // page * page)
            if end <= start:
                continue
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED) == 0:
            done += end - start
    return done


def detect_format(ckpt_dir: Path) -> Optional[str]:
    if (ckpt_dir / "params.json").is_file() and any(ckpt_dir.glob("consolidated.*.pth")):
        return "meta"
    if (ckpt_dir / "config.json").is_file() and any(ckpt_dir.glob("*.safetensors")):
        return "hf"
    return None


def check_dir(ckpt_dir) -> Path:
    path = Path(ckpt_dir).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder")
    try:
        next(path.iterdir(), None)
    except PermissionError:
        raise CheckpointError(f"checkpoint folder {path} is not readable") from None
    return path


def read_model_args(ckpt_dir, **overrides) -> ModelArgs:
    """ModelArgs from params.json (Meta) or config.json (Hugging Face) in ckpt_dir."""
    path = check_dir(ckpt_dir)
    if (path / "params.json").is_file():
        return args_from_params(read_json(path / "params.json"), **overrides)
    if (path / "config.json").is_file():
        return args_from_hf_config(read_json(path / "config.json"), **overrides)
    raise ConfigError(f"{path} has neither params.json (Meta layout) nor config.json (Hugging Face layout)")


def _meta_shard_index(state: dict, args: ModelArgs, mp: int) -> dict[str, Callable[[], torch.Tensor]]:
    """Engine name -> getter of this shard's slice, accepting the fused/renamed keys Meta's files use."""
    index: dict[str, Callable[[], torch.Tensor]] = {}
    hd = args.head_dim
    for key in state:
        if key.endswith("._extra_state") or key == "rope.freqs":
            continue
        m = re.match(r"^(layers\.\d+\.)(.*)$", key)
        prefix, rest = (m.group(1), m.group(2)) if m else ("", key)
        get = lambda k=key: state[k]  # noqa: E731
        if rest == "attention.wqkv.weight":
            # Rows per shard, not heads per shard: MP may exceed n_kv_heads (a shard then holds part of a head).
            q, kv = args.n_heads * hd // mp, args.n_kv_heads * hd // mp
            for i, n in enumerate("qkv"):
                lo = (0, q, q + kv)[i]
                size = q if n == "q" else kv
                index[f"{prefix}attention.w{n}.weight"] = lambda k=key, lo=lo, size=size: state[k][lo : lo + size]
        elif rest == "attention.wqkv.layer_norm_weight":
            index[prefix + "attention_norm.weight"] = get
        elif rest in ("feed_forward.norm.weight", "feed_forward.mlp.layer_norm_weight"):
            index[prefix + "ffn_norm.weight"] = get
        elif rest == "feed_forward.mlp.fc1_weight":
            index[prefix + "feed_forward.w1.weight"] = lambda k=key: state[k].chunk(2, dim=0)[0]
            index[prefix + "feed_forward.w3.weight"] = lambda k=key: state[k].chunk(2, dim=0)[1]
        elif rest == "feed_forward.mlp.fc2_weight":
            index[prefix + "feed_forward.w2.weight"] = get
        elif rest in ("feed_forward.experts.moe_w_in_eD_F", "feed_forward.experts.moe_w_swiglu_eD_F"):
            name = "w1" if "in" in rest else "w3"
            e = args.moe_args.num_experts if args.moe_args else 1
            index[f"{prefix}feed_forward.experts.{name}"] = lambda k=key, e=e: state[k].view(e, -1, state[k].shape[-1])
        elif rest == "feed_forward.experts.moe_w_out_eF_D":
            e = args.moe_args.num_experts if args.moe_args else 1
            index[prefix + "feed_forward.experts.w2"] = lambda k=key, e=e: state[k].view(e, -1, state[k].shape[-1])
        elif rest in ("feed_forward.w_in_shared_FD.weight", "feed_forward.w_swiglu_FD.weight",
                      "feed_forward.w_out_shared_DF.weight"):
            name = {"in": "w1", "sw": "w3", "ou": "w2"}[rest.split(".")[1][2:4]]
            index[f"{prefix}feed_forward.shared_expert.{name}.weight"] = get
        else:
            index[key] = get
    return index


_HF_RENAMES = [
    (r"^model\.embed_tokens\.weight$", "tok_embeddings.weight"),
    (r"^lm_head\.weight$", "output.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight$", r"layers.\1.attention.w\2.weight"),
    (r"^model\.layers\.(\d+)\.input_layernorm\.weight$", r"layers.\1.attention_norm.weight"),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.weight$", r"layers.\1.ffn_norm.weight"),
    (r"^model\.layers\.(\d+)\.feed_forward\.(shared_expert\.)?gate_proj\.weight$", r"layers.\1.feed_forward.\2w1.weight"),
    (r"^model\.layers\.(\d+)\.feed_forward\.(shared_expert\.)?up_proj\.weight$", r"layers.\1.feed_forward.\2w3.weight"),
    (r"^model\.layers\.(\d+)\.feed_forward\.(shared_expert\.)?down_proj\.weight$", r"layers.\1.feed_forward.\2w2.weight"),
    (r"^model\.layers\.(\d+)\.feed_forward\.experts\.down_proj$", r"layers.\1.feed_forward.experts.w2"),
    # The vision tower of Llama4ForConditionalGeneration.
    (r"^(model\.)?multi_modal_projector\.linear_1\.weight$", "vision_projection.weight"),
    (r"^(model\.)?vision_model\.vision_adapter\.mlp\.fc1\.weight$", "vision_embeddings.vision_adapter.mlp.c_fc.weight"),
    (r"^(model\.)?vision_model\.vision_adapter\.mlp\.fc2\.weight$", "vision_embeddings.vision_adapter.mlp.c_proj.weight"),
    (r"^(model\.)?vision_model\.patch_embedding\.linear\.weight$", "vision_embeddings.vision_encoder.conv1._linear.weight"),
    (r"^(model\.)?vision_model\.(class_embedding|positional_embedding_vlm)$", r"vision_embeddings.vision_encoder.\2"),
    (r"^(model\.)?vision_model\.layernorm_(pre|post)\.(weight|bias)$", r"vision_embeddings.vision_encoder.ln_\2.\3"),
    (r"^(model\.)?vision_model\.model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.(weight|bias)$",
     r"vision_embeddings.vision_encoder.transformer.resblocks.\2.attn.w\3.\4"),
    (r"^(model\.)?vision_model\.model\.layers\.(\d+)\.mlp\.fc1\.(weight|bias)$",
     r"vision_embeddings.vision_encoder.transformer.resblocks.\2.mlp.c_fc.\3"),
    (r"^(model\.)?vision_model\.model\.layers\.(\d+)\.mlp\.fc2\.(weight|bias)$",
     r"vision_embeddings.vision_encoder.transformer.resblocks.\2.mlp.c_proj.\3"),
    (r"^(model\.)?vision_model\.model\.layers\.(\d+)\.input_layernorm\.(weight|bias)$",
     r"vision_embeddings.vision_encoder.transformer.resblocks.\2.ln_1.\3"),
    (r"^(model\.)?vision_model\.model\.layers\.(\d+)\.post_attention_layernorm\.(weight|bias)$",
     r"vision_embeddings.vision_encoder.transformer.resblocks.\2.ln_2.\3"),
]


def _hf_name(name: str) -> str:
    """Strip the multimodal wrapper's prefixes so the text model's names remain."""
    for prefix in ("model.language_model.", "language_model.model.", "language_model."):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            return rest if rest.startswith(("model.", "lm_head.")) else "model." + rest
    return name


class Checkpoint:
    """Lazy, resharding view of a bf16 checkpoint folder for model-parallel ``rank`` of ``world_size``."""

    def __init__(self, ckpt_dir, args: Optional[ModelArgs] = None, world_size: int = 1, rank: int = 0):
        self.dir = check_dir(ckpt_dir)
        self.args = args or read_model_args(self.dir)
        self.world_size, self.rank = world_size, rank
        self.format = detect_format(self.dir)
        self._index: Optional[dict[str, Callable[[], torch.Tensor]]] = None
        self._sources: list[dict[str, Callable[[], torch.Tensor]]] = []
        self._chunk: tuple[int, int] = (1, 0)  # (pieces, which) when one file feeds several ranks

    # --- opening ------------------------------------------------------------------------
    def meta_shards(self) -> list[Path]:
        shards = sorted(self.dir.glob("consolidated.*.pth"))
        numbers = [int(_SHARD_RE.search(p.name).group(1)) for p in shards if _SHARD_RE.search(p.name)]
        if numbers != list(range(len(numbers))):
            missing = sorted(set(range(max(numbers) + 1)) - set(numbers)) if numbers else [0]
            raise CheckpointError(f"{self.dir} lacks shard consolidated.{missing[0]:02d}.pth")
        return shards

    def _open(self) -> None:
        if self._index is not None:
            return
        if self.format == "meta":
            self._open_meta()
        elif self.format == "hf":
            self._open_hf()
        else:
            raise CheckpointError(
                f"{self.dir} holds no bf16 weights (neither consolidated.NN.pth with params.json "
                "nor *.safetensors with config.json)"
            )

    def _open_meta(self) -> None:
        shards = self.meta_shards()
        old, new = len(shards), self.world_size
        if new % old == 0:
            picked = [self.rank * old // new]
            self._chunk = (new // old, self.rank % (new // old))
        elif old % new == 0:
            f = old // new
            picked = list(range(self.rank * f, (self.rank + 1) * f))
        else:
            raise CheckpointError(
                f"a checkpoint with {old} model-parallel shards cannot be loaded on world size {new} "
                "(one must be a multiple of the other)"
            )
        self.source_mp = old
        self._sources = [_meta_shard_index(load_pth(shards[i]), self.args, old) for i in picked]
        keys = set(self._sources[0])
        for i, src in zip(picked[1:], self._sources[1:]):
            if set(src) != keys:
                raise CheckpointError(f"shard {shards[i].name} holds different tensors from {shards[picked[0]].name}")
        self._index = self._sources[0]
        self._check_shard_count(shards[picked[0]].name, old)

    def _check_shard_count(self, first: str, old: int) -> None:
        """A checkpoint that lost its last shard(s) looks like a smaller MP size; the vocabulary split tells."""
        vocab, get = self.args.vocab_size, self._index.get("tok_embeddings.weight")
        rows = get().shape[0] if get is not None else 0
        if vocab > 0 and rows and rows * old < vocab and vocab % rows == 0:
            raise CheckpointError(
                f"{first} holds 1/{vocab // rows} of the vocabulary, so the checkpoint has {vocab // rows} shards, "
                f"but only {old} consolidated.NN.pth file(s) are in {self.dir} (consolidated.{old:02d}.pth is missing)"
            )

    def _open_hf(self) -> None:
        from safetensors import SafetensorError, safe_open

        index: dict[str, Callable[[], torch.Tensor]] = {}
        for path in sorted(self.dir.glob("*.safetensors")):
            try:
                handle = safe_open(str(path), framework="pt")
                names = list(handle.keys())
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot read {path}: corrupted safetensors file ({e})") from None
            for raw in names:
                name = _hf_name(raw)
                get = lambda h=handle, r=raw: h.get_tensor(r)  # noqa: E731
                m = re.match(r"^model\.layers\.(\d+)\.feed_forward\.(router\.weight|experts\.gate_up_proj)$", name)
                if m and m.group(2) == "router.weight":
                    index[f"layers.{m.group(1)}.feed_forward.router_DE"] = lambda g=get: g().t()
                elif m:
                    p = f"layers.{m.group(1)}.feed_forward.experts."
                    index[p + "w1"] = lambda g=get: g().chunk(2, dim=-1)[0]
                    index[p + "w3"] = lambda g=get: g().chunk(2, dim=-1)[1]
                else:
                    for pattern, repl in _HF_RENAMES:
                        new, n = re.subn(pattern, repl, name)
                        if n:
                            index[new] = get
                            break
        self.source_mp = 1
        self._sources = [index]
        self._chunk = (self.world_size, self.rank)
        self._index = index

    def files(self) -> list[Path]:
        """The weight files this view reads."""
        if self.format == "meta":
            return self.meta_shards()
        return sorted(self.dir.glob("*.safetensors")) if self.format == "hf" else []

    def release(self, within: Optional[tuple[int, int]] = None) -> None:
        """Drop the resident pages of the files read so far (see ``release_file_pages``)."""
        if self._index is not None:
            release_file_pages(self.files(), within)

    # --- access -------------------------------------------------------------------------
    def keys(self) -> list[str]:
        self._open()
        return list(self._index)

    def __contains__(self, name: str) -> bool:
        self._open()
        return name in self._index

    def get(self, name: str) -> torch.Tensor:
        """This rank's slice of parameter ``name``."""
        self._open()
        if name not in self._index:
            raise CheckpointError(f"{self.dir} lacks the tensor {name!r} (shards from a different model?)")
        axis = split_axis(name)
        try:
            parts = [src[name]() for src in self._sources]
        except (RuntimeError, OSError) as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {self.dir}: {e}") from None
        if axis is None:
            return parts[0]
        t = torch.cat(parts, dim=axis) if len(parts) > 1 else parts[0]
        pieces, which = self._chunk
        if pieces > 1:
            if t.shape[axis] % pieces:
                raise CheckpointError(f"tensor {name!r} of shape {tuple(t.shape)} cannot be split {pieces} ways")
            t = t.chunk(pieces, dim=axis)[which]
        return t


def hf_quant_method(ckpt_dir) -> Optional[str]:
    """The ``quant_method`` of a Hugging Face folder's config.json, or None for plain weights."""
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file() or (Path(ckpt_dir) / "params.json").is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if q is None and isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        q = cfg["text_config"].get("quantization_config")
    return str(q.get("quant_method", "unknown method")) if isinstance(q, dict) else None


def set_tensor(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace parameter ``name`` (dotted path) of ``module`` by ``tensor``."""
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    setattr(owner, attr, nn.Parameter(tensor, requires_grad=False))


# Read one row per token, at random: a view into the memory-mapped checkpoint waits on a disk read
# for a token whose page is not cached (20-60 ms a token measured for the bench preset's table
# after loading had evicted it), so these are copied into memory at load.
RANDOM_ACCESS = ("tok_embeddings.weight",)


def loaded_tensor(name: str, t: torch.Tensor, device, dtype: torch.dtype) -> torch.Tensor:
    """Checkpoint tensor ``t`` as parameter ``name``: in ``dtype`` on ``device``, contiguous, and
    for RANDOM_ACCESS names never a view of the checkpoint file."""
    out = t.to(device=device, dtype=dtype).contiguous()
    if name in RANDOM_ACCESS and out.data_ptr() == t.data_ptr():
        out = out.clone()
    return out


def load_weights(model: nn.Module, checkpoint: Checkpoint, dtype: torch.dtype = torch.bfloat16, device=None) -> nn.Module:
    """The default loader: every parameter lands once, in ``dtype`` on ``device``."""
    device = torch.device(device or "cpu")
    method = hf_quant_method(checkpoint.dir)
    if method is not None:
        raise CheckpointError(
            f"{checkpoint.dir} holds quantized weights ({method}); load it with the quantized loader "
            "(quantization.build, or the scripts, which detect it)"
        )
    # Layers beyond n_layers mean params.json describes a smaller model; other extra keys are ignored,
    # as the reference's non-strict load does.
    n_layers = checkpoint.args.n_layers
    layer_of = (re.match(r"layers\.(\d+)\.", k) for k in checkpoint.keys())
    extra = sorted(m.string for m in layer_of if m and int(m.group(1)) >= n_layers)
    if extra:
        raise CheckpointError(
            f"the checkpoint has weights of layers beyond the {n_layers} in its config, e.g. {extra[0]!r} "
            "(params.json does not match the weights)"
        )
    for name, param in list(model.named_parameters()):
        t = checkpoint.get(name)
        if tuple(t.shape) != tuple(param.shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(t.shape)} in the checkpoint but the model expects "
                f"{tuple(param.shape)} (params.json does not match the weights)"
            )
        set_tensor(model, name, loaded_tensor(name, t, device, dtype))
    return model


def write_meta_checkpoint(out_dir, params: dict, shards: list[dict]) -> None:
    """Write params.json and one consolidated.NN.pth per shard."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "params.json").write_text(json.dumps(params, indent=2))
    for i, sd in enumerate(shards):
        torch.save(sd, out / f"consolidated.{i:02d}.pth")
