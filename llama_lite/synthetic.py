"""Random-weight Llama 4 checkpoints in Meta's or Hugging Face's layout, so every path runs
without downloads. Weights are scaled so activations and logits stay O(1) and routing is decisive."""

import json
import os
import re
import shutil
import struct
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import Callable, Optional

import torch

from .args import MoEArgs, ModelArgs
from .checkpoint import split_axis
from .errors import ConfigError

VOCAB = 202048  # Llama 4's tokenizer: 200000 BPE tokens + 2048 special tokens

PRESETS: dict[str, dict] = {
    # Tests: every feature on (iRoPE, chunking, temperature tuning, dense + MoE layers), small dims.
    "tiny": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim_multiplier=1.0, multiple_of=256, ffn_exp=4.0,
                 attention_chunk_size=8, nope_layer_interval=2, use_qk_norm=True,
                 attn_temperature_tuning=True, floor_scale=4.0, attn_scale=0.1,
                 use_scaled_rope=True, rope_scaling_factor=16.0, rope_high_freq_factor=1.0,
                 moe_args=dict(num_experts=4, top_k=1, interleave_moe_layer_step=1)),
    # Demos: ~130M parameters (two thirds of them the 202k-token embedding and output).
    "small": dict(dim=256, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim_multiplier=1.0, multiple_of=256, ffn_exp=4.0,
                  attention_chunk_size=8192, nope_layer_interval=4, use_qk_norm=True,
                  attn_temperature_tuning=True, moe_args=dict(num_experts=8, top_k=1)),
    # Benchmarks: ~4.6B parameters, 8 experts of hidden 4096 in every layer.
    "bench": dict(dim=2048, n_layers=16, n_heads=16, n_kv_heads=4, ffn_dim_multiplier=1.0, multiple_of=256, ffn_exp=3.0,
                  attention_chunk_size=8192, nope_layer_interval=4, use_qk_norm=True,
                  attn_temperature_tuning=True,
                  moe_args=dict(num_experts=8, top_k=1, auto_scale_F=False)),
}

# A small vision tower for any preset (random_checkpoint --vision): 56-pixel tiles of 4x4 patches,
# 4 embeddings per tile after pixel shuffle. Sized so Hugging Face's config describes it too
# (its intermediate_size is both the encoder's MLP width and the adapter's input).
VISION_ARGS: dict = dict(image_size=56, patch_size=14, dim=32, n_layers=2, n_heads=2, mlp_ratio=4.0, output_dim=64,
                         pixel_shuffle_ratio=0.5)


def preset_args(preset: str, **overrides) -> ModelArgs:
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    values = {**PRESETS[preset], "vocab_size": VOCAB, **overrides}
    moe = values.pop("moe_args", None)
    if isinstance(moe, dict):
        moe = MoEArgs(**moe)
    return ModelArgs(**values, moe_args=moe)


def _groups(args: ModelArgs, rand: Callable[..., torch.Tensor], norm: Callable[[int], torch.Tensor]):
    """The unsharded model under the engine's names, one group at a time (embeddings, each layer, then
    the final norm and output), drawn in one fixed order so the values do not depend on the consumer."""
    d, hd = args.dim, args.head_dim
    yield {"tok_embeddings.weight": rand(args.vocab_size, d, std=1.0)}
    for i in range(args.n_layers):
        p, sd = f"layers.{i}.", {}
        sd[p + "attention.wq.weight"] = rand(args.n_heads * hd, d, std=d**-0.5)
        sd[p + "attention.wk.weight"] = rand(args.n_kv_heads * hd, d, std=d**-0.5)
        sd[p + "attention.wv.weight"] = rand(args.n_kv_heads * hd, d, std=d**-0.5)
        sd[p + "attention.wo.weight"] = rand(d, args.n_heads * hd, std=(args.n_heads * hd) ** -0.5 / 2)
        sd[p + "attention_norm.weight"] = norm(d)
        sd[p + "ffn_norm.weight"] = norm(d)
        if args.is_moe_layer(i):
            e, f = args.moe_args.num_experts, args.expert_hidden_dim()
            sd[p + "feed_forward.router_DE"] = rand(d, e, std=d**-0.5 * 4)
            sd[p + "feed_forward.experts.w1"] = rand(e, d, f, std=d**-0.5)
            sd[p + "feed_forward.experts.w3"] = rand(e, d, f, std=d**-0.5)
            sd[p + "feed_forward.experts.w2"] = rand(e, f, d, std=f**-0.5 / 2)
            prefix, hidden = p + "feed_forward.shared_expert.", f
        else:
            prefix, hidden = p + "feed_forward.", args.dense_hidden_dim()
        sd[prefix + "w1.weight"] = rand(hidden, d, std=d**-0.5)
        sd[prefix + "w3.weight"] = rand(hidden, d, std=d**-0.5)
        sd[prefix + "w2.weight"] = rand(d, hidden, std=hidden**-0.5 / 2)
        yield sd
    yield {"norm.weight": norm(d), "output.weight": rand(args.vocab_size, d, std=d**-0.5 * 2)}
    if args.vision_args is not None:  # last, so a vision tower leaves the text weights of a seed unchanged
        yield _vision_group(args.vision_args, d, rand, norm)


def _vision_group(v, text_dim: int, rand, norm) -> dict[str, torch.Tensor]:
    c, p, out = v.dim, v.patch_size, v.output_dim
    hidden, side = int(v.mlp_ratio * c), v.image_size // v.patch_size
    e, sd = "vision_embeddings.vision_encoder.", {}
    sd[e + "conv1._linear.weight"] = rand(c, 3 * p * p, std=(3 * p * p) ** -0.5)
    sd[e + "class_embedding"] = rand(c, std=1.0)
    sd[e + "positional_embedding_vlm"] = rand(side * side + 1, c, std=0.5)
    for name in ("ln_pre", "ln_post"):
        sd[e + name + ".weight"], sd[e + name + ".bias"] = norm(c), rand(c, std=0.1)
    for i in range(v.n_layers):
        b = f"{e}transformer.resblocks.{i}."
        for w in ("wq", "wk", "wv", "wo"):
            sd[b + f"attn.{w}.weight"] = rand(c, c, std=c**-0.5 / (2 if w == "wo" else 1))
            sd[b + f"attn.{w}.bias"] = rand(c, std=0.1)
        for name in ("ln_1", "ln_2"):
            sd[b + name + ".weight"], sd[b + name + ".bias"] = norm(c), rand(c, std=0.1)
        sd[b + "mlp.c_fc.weight"], sd[b + "mlp.c_fc.bias"] = rand(hidden, c, std=c**-0.5), rand(hidden, std=0.1)
        sd[b + "mlp.c_proj.weight"], sd[b + "mlp.c_proj.bias"] = rand(c, hidden, std=hidden**-0.5 / 2), rand(c, std=0.1)
    a = "vision_embeddings.vision_adapter.mlp."
    shuffled = int(c / v.pixel_shuffle_ratio**2)
    sd[a + "c_fc.weight"] = rand(out, shuffled, std=shuffled**-0.5 * 2)
    sd[a + "c_proj.weight"] = rand(out, out, std=out**-0.5 * 2)
    sd["vision_projection.weight"] = rand(text_dim, out, std=out**-0.5)
    return sd


def random_groups(args: ModelArgs, seed: int = 0):
    """Random bf16 weights, one group (embeddings, a layer, norm + output) at a time."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, std: float) -> torch.Tensor:
        # In place: for the embeddings of large presets a second fp32 temporary would cost gigabytes.
        return torch.randn(*shape, generator=g).mul_(std).to(torch.bfloat16)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)

    return _groups(args, rand, norm)


def shape_groups(args: ModelArgs):
    """The groups of ``random_groups`` as meta tensors: shapes only, nothing drawn or allocated."""

    def rand(*shape, std: float) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")

    return _groups(args, rand, lambda n: rand(n, std=1.0))


def random_state_dict(args: ModelArgs, seed: int = 0) -> dict[str, torch.Tensor]:
    """The whole (unsharded) model under the engine's parameter names, bf16."""
    return {k: v for group in random_groups(args, seed) for k, v in group.items()}


def shard_state_dict(sd: dict[str, torch.Tensor], mp: int) -> list[dict[str, torch.Tensor]]:
    """Split into ``mp`` model-parallel shards (engine names)."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(mp)]
    for name, t in sd.items():
        axis = split_axis(name)
        parts = [t] * mp if axis is None else t.chunk(mp, dim=axis)
        for shard, part in zip(shards, parts):
            shard[name] = part.clone()
    return shards


def to_meta_keys(shard: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Engine names -> the fused key layout of Meta's released consolidated.NN.pth files."""
    out: dict[str, torch.Tensor] = {}
    for name, t in shard.items():
        layer, _, rest = name.partition(".")
        if not name.startswith("layers."):
            out[name] = t
            continue
        idx, _, rest = rest.partition(".")
        p = f"layers.{idx}."
        if rest == "attention.wq.weight":
            out[p + "attention.wqkv.weight"] = torch.cat(
                [t, shard[p + "attention.wk.weight"], shard[p + "attention.wv.weight"]], dim=0
            )
        elif rest in ("attention.wk.weight", "attention.wv.weight"):
            continue
        elif rest == "attention_norm.weight":
            out[p + "attention.wqkv.layer_norm_weight"] = t
        elif rest == "ffn_norm.weight":
            dense = p + "feed_forward.w1.weight" in shard
            out[p + ("feed_forward.mlp.layer_norm_weight" if dense else "feed_forward.norm.weight")] = t
        elif rest == "feed_forward.w1.weight":
            out[p + "feed_forward.mlp.fc1_weight"] = torch.cat([t, shard[p + "feed_forward.w3.weight"]], dim=0)
        elif rest == "feed_forward.w3.weight":
            continue
        elif rest == "feed_forward.w2.weight":
            out[p + "feed_forward.mlp.fc2_weight"] = t
        elif rest.startswith("feed_forward.experts."):
            key = {"w1": "moe_w_in_eD_F", "w3": "moe_w_swiglu_eD_F", "w2": "moe_w_out_eF_D"}[rest.rsplit(".", 1)[1]]
            out[p + "feed_forward.experts." + key] = t.reshape(-1, t.shape[-1])
        elif rest.startswith("feed_forward.shared_expert."):
            key = {"w1": "w_in_shared_FD", "w3": "w_swiglu_FD", "w2": "w_out_shared_DF"}[rest.split(".")[2]]
            out[p + f"feed_forward.{key}.weight"] = t
        else:
            out[name] = t
    return out


def hf_vision_config(v) -> dict:
    return {
        "model_type": "llama4_vision_model",
        "hidden_size": v.dim,
        "num_hidden_layers": v.n_layers,
        "num_attention_heads": v.n_heads,
        "num_channels": 3,
        "intermediate_size": int(v.mlp_ratio * v.dim),
        "image_size": v.image_size,
        "patch_size": v.patch_size,
        "pixel_shuffle_ratio": v.pixel_shuffle_ratio,
        "projector_input_dim": v.output_dim,
        "projector_output_dim": v.output_dim,
        "vision_output_dim": v.output_dim,
        "norm_eps": v.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": v.rope_theta},
    }


def hf_config(args: ModelArgs) -> dict:
    """config.json: Llama4ForCausalLM, or Llama4ForConditionalGeneration when the model has a vision tower."""
    text = hf_text_config(args)
    if args.vision_args is None:
        return text
    text = {k: v for k, v in text.items() if k != "architectures"}
    return {
        "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text,
        "vision_config": hf_vision_config(args.vision_args), "boi_token_index": 200080, "eoi_token_index": 200081,
        "image_token_index": 200092, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }


_HF_VISION_NAMES = [
    (r"^vision_projection\.weight$", "multi_modal_projector.linear_1.weight"),
    (r"^vision_embeddings\.vision_adapter\.mlp\.c_fc\.", "vision_model.vision_adapter.mlp.fc1."),
    (r"^vision_embeddings\.vision_adapter\.mlp\.c_proj\.", "vision_model.vision_adapter.mlp.fc2."),
    (r"^vision_embeddings\.vision_encoder\.conv1\._linear\.", "vision_model.patch_embedding.linear."),
    (r"^vision_embeddings\.vision_encoder\.ln_(pre|post)\.", r"vision_model.layernorm_\1."),
    (r"^vision_embeddings\.vision_encoder\.transformer\.resblocks\.(\d+)\.attn\.w([qkvo])\.",
     r"vision_model.model.layers.\1.self_attn.\2_proj."),
    (r"^vision_embeddings\.vision_encoder\.transformer\.resblocks\.(\d+)\.mlp\.c_fc\.", r"vision_model.model.layers.\1.mlp.fc1."),
    (r"^vision_embeddings\.vision_encoder\.transformer\.resblocks\.(\d+)\.mlp\.c_proj\.", r"vision_model.model.layers.\1.mlp.fc2."),
    (r"^vision_embeddings\.vision_encoder\.transformer\.resblocks\.(\d+)\.ln_1\.", r"vision_model.model.layers.\1.input_layernorm."),
    (r"^vision_embeddings\.vision_encoder\.transformer\.resblocks\.(\d+)\.ln_2\.",
     r"vision_model.model.layers.\1.post_attention_layernorm."),
    (r"^vision_embeddings\.vision_encoder\.", "vision_model."),
]


def hf_text_config(args: ModelArgs) -> dict:
    moe_layers = [i for i in range(args.n_layers) if args.is_moe_layer(i)]
    cfg = {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "intermediate_size": args.expert_hidden_dim() if args.moe_args else args.dense_hidden_dim(),
        "intermediate_size_mlp": args.dense_hidden_dim(),
        "num_local_experts": args.moe_args.num_experts if args.moe_args else 1,
        "num_experts_per_tok": args.moe_args.top_k if args.moe_args else 1,
        "interleave_moe_layer_step": args.moe_args.interleave_moe_layer_step if args.moe_args else 0,
        "moe_layers": moe_layers,
        "no_rope_layers": [0 if args.is_nope_layer(i) else 1 for i in range(args.n_layers)],
        "use_qk_norm": args.use_qk_norm,
        "attention_chunk_size": args.attention_chunk_size,
        "attn_temperature_tuning": args.attn_temperature_tuning,
        "floor_scale": int(args.floor_scale) if float(args.floor_scale).is_integer() else args.floor_scale,
        "attn_scale": args.attn_scale,
        "max_position_embeddings": max(args.max_seq_len, 8192),
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "bos_token_id": 200000,
        "eos_token_id": [200001, 200007, 200008],
        "pad_token_id": 200018,
    }
    if args.use_scaled_rope:
        cfg["rope_scaling"] = {
            "rope_type": "llama3", "factor": args.rope_scaling_factor, "high_freq_factor": args.rope_high_freq_factor,
            "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
        }
    return cfg


def to_hf_keys(sd: dict[str, torch.Tensor], multimodal: bool = False) -> dict[str, torch.Tensor]:
    """Engine names -> Hugging Face's; ``multimodal``: Llama4ForConditionalGeneration's (text under language_model.)."""
    out: dict[str, torch.Tensor] = {}
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    for name, t in sd.items():
        if name.startswith("vision_"):
            out[next(re.sub(p, r, name) for p, r in _HF_VISION_NAMES if re.search(p, name))] = t
        elif name == "tok_embeddings.weight":
            out["model.embed_tokens.weight"] = t
        elif name == "output.weight":
            out["lm_head.weight"] = t
        elif name == "norm.weight":
            out["model.norm.weight"] = t
        else:
            _, idx, rest = name.split(".", 2)
            p = f"model.layers.{idx}."
            if rest.startswith("attention.w"):
                out[p + f"self_attn.{rest[11]}_proj.weight"] = t
            elif rest == "attention_norm.weight":
                out[p + "input_layernorm.weight"] = t
            elif rest == "ffn_norm.weight":
                out[p + "post_attention_layernorm.weight"] = t
            elif rest == "feed_forward.router_DE":
                out[p + "feed_forward.router.weight"] = t.t().contiguous()
            elif rest == "feed_forward.experts.w1":
                out[p + "feed_forward.experts.gate_up_proj"] = torch.cat([t, sd[f"layers.{idx}.feed_forward.experts.w3"]], -1)
            elif rest == "feed_forward.experts.w3":
                continue
            elif rest == "feed_forward.experts.w2":
                out[p + "feed_forward.experts.down_proj"] = t
            else:  # dense or shared expert SwiGLU
                parts = rest.split(".")
                parts[-2] = names[parts[-2]]
                out[p + ".".join(parts)] = t
    if multimodal:
        out = {("language_model." + k if not k.startswith(("vision_model.", "multi_modal")) else k): v
               for k, v in out.items()}
    return out


def _meta_shard_groups(groups, args: ModelArgs, mp: int):
    """Each group split into ``mp`` shards under Meta's fused keys: a list of ``mp`` dicts per group."""
    for group in groups:
        yield [to_meta_keys(shard, args) for shard in shard_state_dict(group, mp)]


def _pwrite_all(fd: int, tensor: torch.Tensor, offset: int) -> int:
    """Write the tensor's bytes at ``offset``; returns their CRC-32."""
    data = memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())
    crc = zlib.crc32(data)
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
    return crc


def _set_zip_crcs(path: Path, crcs: dict[int, int]) -> None:
    """Fill in the CRC-32 of records whose bytes were written after torch.save(skip_data) left them
    out (``crcs``: data offset -> CRC): in each record's data descriptor and its central directory
    entry, the two places torch's writer puts it. The file then equals what torch.save writes (up to
    the random serialization id every save carries)."""
    with zipfile.ZipFile(path) as zf:
        infos, entry = zf.infolist(), zf.start_dir
    with open(path, "r+b") as f:
        for info in infos:  # the central directory lists the records in this order
            f.seek(entry)
            head = f.read(46)
            assert head[:4] == b"PK\x01\x02", f"{path}: unexpected zip layout"
            f.seek(info.header_offset + 26)
            data = info.header_offset + 30 + sum(struct.unpack("<HH", f.read(4)))
            if data in crcs:
                crc = struct.pack("<I", crcs[data])
                f.seek(data + info.compress_size)
                signed = f.read(4) == b"PK\x07\x08"  # the data descriptor's optional signature
                f.seek(data + info.compress_size + (4 if signed else 0))
                f.write(crc)
                f.seek(entry + 16)
                f.write(crc)
            entry += 46 + sum(struct.unpack("<HHH", head[28:34]))


def _record_offsets(path: Path) -> dict[str, int]:
    """File offset of each tensor's bytes in a .pth written by torch.save (one storage per tensor).

    torch.load(mmap=True) maps the whole file once, so a storage's address minus the mapping's
    start is its offset; the start follows from the lowest offset of a data record.
    """
    mapped = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    reader = torch._C.PyTorchFileReader(str(path))
    first = min(reader.get_record_offset(r) for r in reader.get_all_records() if re.fullmatch(r"data/\d+", r))
    pointers = {k: t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size() for k, t in mapped.items()}
    base = min(pointers.values()) - first
    return {k: ptr - base for k, ptr in pointers.items()}


def _write_meta(out: Path, args: ModelArgs, seed: int, mp: int, progress: Callable[[int], None]) -> None:
    """consolidated.NN.pth files written one group at a time, so memory holds one layer, not the model.

    torch.save needs every tensor at once, so each file is first saved with its storages left
    empty (skip_data), then the random tensors are written into place group by group.
    """
    skeletons: list[dict[str, torch.Tensor]] = [{} for _ in range(mp)]
    for shards in _meta_shard_groups(shape_groups(args), args, mp):
        for skeleton, shard in zip(skeletons, shards):
            # CPU tensors from torch.empty: address space only, their pages are never touched.
            skeleton.update({k: torch.empty(v.shape, dtype=v.dtype) for k, v in shard.items()})
    paths = [out / f"consolidated.{i:02d}.pth" for i in range(mp)]
    for path, skeleton in zip(paths, skeletons):
        with torch.serialization.skip_data():
            torch.save(skeleton, path)
    del skeletons
    offsets = [_record_offsets(p) for p in paths]
    crcs: list[dict[int, int]] = [{} for _ in range(mp)]
    fds = [os.open(p, os.O_WRONLY) for p in paths]
    try:
        for shards in _meta_shard_groups(random_groups(args, seed), args, mp):
            for fd, where, crc, shard in zip(fds, offsets, crcs, shards):
                for name, t in shard.items():
                    crc[where[name]] = _pwrite_all(fd, t, where[name])
                    progress(t.numel() * t.element_size())
    finally:
        for fd in fds:
            os.close(fd)
    for path, crc in zip(paths, crcs):
        _set_zip_crcs(path, crc)


def _write_safetensors(path: Path, args: ModelArgs, seed: int, progress: Callable[[int], None]) -> None:
    """One model.safetensors written one group at a time: the header (from shapes alone), then the bytes in order."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    multimodal = args.vision_args is not None
    end = 0
    for group in shape_groups(args):
        for name, t in to_hf_keys(group, multimodal).items():
            size = t.numel() * t.element_size()
            header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [end, end + size]}
            end += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors itself writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for group in random_groups(args, seed):
            for name, t in to_hf_keys(group, multimodal).items():
                f.write(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))
                progress(t.numel() * t.element_size())


def checkpoint_bytes(args: ModelArgs) -> int:
    """Bytes of weights a random checkpoint of ``args`` holds (bf16, any MP size)."""
    return sum(t.numel() * t.element_size() for group in shape_groups(args) for t in group.values())


def write_random_checkpoint(
    out_dir,
    preset: str = "tiny",
    mp: int = 1,
    seed: int = 0,
    fmt: str = "meta",
    tokenizer_path: Optional[Path] = None,
    overrides: Optional[dict] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> Path:
    """Write a complete checkpoint folder (weights, params/config, tokenizer.model). Returns its path.

    Weights are generated and written one layer at a time, so memory stays near the size of the
    largest layer (or the embeddings) whatever the preset. ``progress(n)`` is called after each
    ``n`` bytes of weights written; ``checkpoint_bytes`` gives the total. The folder is written
    under a temporary name and renamed when complete; an existing ``out_dir`` is replaced.
    """
    from .tokenizer import default_tokenizer_path

    if fmt not in ("meta", "hf"):
        raise ConfigError(f"unknown checkpoint format {fmt!r}; choose meta or hf")
    if not isinstance(mp, int) or isinstance(mp, bool) or mp < 1:
        raise ConfigError(f"mp must be a positive integer, got {mp!r}")
    if fmt == "hf" and mp != 1:
        raise ConfigError("the Hugging Face layout is written unsharded (mp=1)")
    args = preset_args(preset, **(overrides or {}))
    progress = progress or (lambda n: None)
    out = Path(out_dir).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        if fmt == "meta":
            (tmp / "params.json").write_text(json.dumps(args.to_params(), indent=2))
            _write_meta(tmp, args, seed, mp, progress)
        else:
            (tmp / "config.json").write_text(json.dumps(hf_config(args), indent=2))
            _write_safetensors(tmp / "model.safetensors", args, seed, progress)
        shutil.copyfile(tokenizer_path or default_tokenizer_path(), tmp / "tokenizer.model")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
