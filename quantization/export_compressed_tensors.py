"""Write a quantized model as a compressed-tensors Hugging Face folder (what vLLM serves).

The layout is llm-compressor's for Llama 4: transformers' names, experts one Linear per expert
and projection (``feed_forward.experts.{e}.gate_proj``), one config group targeting ``Linear``
with every Linear left in bf16 named in ``ignore``. Quantized weights keep their numbers:

- int4 -> ``pack-quantized`` (W4A16): ``weight_packed`` int32, ``weight_scale``, ``weight_shape``;
- fp8 rowwise -> ``float-quantized`` (FP8_DYNAMIC): ``weight`` e4m3, ``weight_scale`` [N, 1] fp32;
- nvfp4 -> ``nvfp4-pack-quantized`` (NVFP4A16, or NVFP4 with a static input global scale).

- w4a8 -> ``int-quantized`` (W4AFP8, as llm-compressor writes it): ``weight`` int8 values and the
  bf16 group scales w4a8 is derived from, with dynamic per-token fp8 activations. compressed-tensors
  has no per-channel scale, so the fp8 group and fp32 channel scales are derived on load, by
  llama-lite (``w4a8_from_int4``) as by vLLM; pass the model's int4 weights (``w4a8=True``).

compressed-tensors' dequantization of int4, fp8 and nvfp4 is the weight llama-lite computes with
(its products of values and scales are exact in fp32). Its per-token fp8 activations have no scale
bound; the fp8 format's bound (1200) only matters for rows whose largest activation exceeds it.
"""

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from kernels.formats import Fp8Weight, Int4Weight, NVFP4Weight, QuantizedWeight, W4A8Weight, select_expert, unpack_int4
from llama_lite.args import ModelArgs
from llama_lite.errors import ConfigError
from llama_lite.model import Experts, FeedForward, MoE, Transformer

from .modules import QuantizedExperts, QuantizedFeedForward

_PROJ = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))

_W4A16 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "dynamic": False}
_FP8_TOKEN = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True,
              "group_size": None}
_W4AFP8 = ("int-quantized", lambda w: ({**_W4A16, "group_size": w.group_size}, _FP8_TOKEN))
_SCHEMES = {
    Int4Weight: ("pack-quantized", lambda w: ({**_W4A16, "group_size": w.group_size}, None)),
    Fp8Weight: ("float-quantized", lambda w: (
        {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
         "group_size": None}, _FP8_TOKEN)),
    NVFP4Weight: ("nvfp4-pack-quantized", lambda w: (
        {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "dynamic": False,
         "group_size": 16, "scale_dtype": "torch.float8_e4m3fn"},
        None if w.input_global_scale is None else
        {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "dynamic": "local",
         "group_size": 16, "scale_dtype": "torch.float8_e4m3fn"})),
}


def compressed_tensors(w: QuantizedWeight, w4a8: bool = False) -> dict[str, torch.Tensor]:
    """The stored tensors of one 2-D quantized weight, by compressed-tensors' parameter names
    (``w4a8``: int4 weights written as W4AFP8)."""
    if isinstance(w, Int4Weight) and w4a8:
        return {"weight": unpack_int4(w.qweight), "weight_scale": w.scales.contiguous()}
    if isinstance(w, Int4Weight):
        n, k2 = w.qweight.shape
        if k2 % 4:
            raise ConfigError(f"int4 weights need an input size divisible by 8 for compressed-tensors, got {k2 * 2}")
        # llama-lite's bytes hold two values, low nibble first; compressed-tensors stores q + 8 in
        # the same nibbles of little-endian int32 words: xor 8 in each nibble.
        packed = (w.qweight ^ 0x88).contiguous().view(torch.int32)
        return {"weight_packed": packed, "weight_scale": w.scales.contiguous(),
                "weight_shape": torch.tensor([n, k2 * 2])}
    if isinstance(w, Fp8Weight):
        return {"weight": w.weight.contiguous(), "weight_scale": w.scale.float().reshape(-1, 1).contiguous()}
    if isinstance(w, NVFP4Weight):
        out = {"weight_packed": w.qweight.contiguous(), "weight_scale": w.scales.contiguous(),
               "weight_global_scale": w.global_scale.float().reshape(1)}
        if w.input_global_scale is not None:
            out["input_global_scale"] = w.input_global_scale.float().reshape(1)
        return out
    if isinstance(w, W4A8Weight):
        raise ConfigError("w4a8 is written from its int4 weights (the fp8 and channel scales are derived on load)")
    raise TypeError(f"not a quantized weight: {type(w).__name__}")


def _linear_weight(module: nn.Module):
    w = module.weight
    return w if not isinstance(w, nn.Parameter) else w.detach()


def hf_tensors(model: Transformer, w4a8: bool = False):
    """(stored tensors, quantized Linear names, bf16 Linear names) of a whole (world size 1) model."""
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    plain: list[str] = []

    def linear(name: str, w) -> None:
        if isinstance(w, torch.Tensor):
            tensors[f"{name}.weight"] = w.to(torch.bfloat16).contiguous()
            plain.append(name)
        else:
            quantized[name] = w
            tensors.update({f"{name}.{k}": v for k, v in compressed_tensors(w, w4a8).items()})

    tensors["model.embed_tokens.weight"] = model.tok_embeddings.weight.detach()
    tensors["model.norm.weight"] = model.norm.weight.detach()
    linear("lm_head", _linear_weight(model.output))
    for block in model.layers:
        p = f"model.layers.{block.layer_id}."
        tensors[p + "input_layernorm.weight"] = block.attention_norm.weight.detach()
        tensors[p + "post_attention_layernorm.weight"] = block.ffn_norm.weight.detach()
        for n in "qkvo":
            linear(p + f"self_attn.{n}_proj", _linear_weight(getattr(block.attention, f"w{n}")))
        ff = block.feed_forward
        if isinstance(ff, MoE):
            tensors[p + "feed_forward.router.weight"] = ff.router_DE.detach().t().contiguous()
            plain.append(p + "feed_forward.router")
            experts = ff.experts
            for ours, theirs in _PROJ:
                w = getattr(experts, ours)
                for e in range(experts.num_experts):
                    if isinstance(experts, QuantizedExperts) and not isinstance(w, torch.Tensor):
                        we = select_expert(w, e)
                    else:  # the core's Experts hold [E, K, N]; a quantized module may keep one bf16 weight [E, N, K]
                        we = w[e].detach().t() if isinstance(experts, Experts) else w[e]
                    linear(p + f"feed_forward.experts.{e}.{theirs}", we)
            mlp, prefix = ff.shared_expert, p + "feed_forward.shared_expert."
        else:
            mlp, prefix = ff, p + "feed_forward."
        for ours, theirs in _PROJ:
            w = getattr(mlp, ours)
            linear(prefix + theirs, w if isinstance(mlp, QuantizedFeedForward) else _linear_weight(w))
    return tensors, quantized, plain


def quantization_config(quantized: dict, plain: list, w4a8: bool = False) -> dict:
    """config.json's ``quantization_config``: one group for the one format the model uses."""
    kinds = {type(w) for w in quantized.values()}
    if not kinds:
        raise ConfigError("the model has no quantized weights to write as compressed-tensors")
    if len(kinds) > 1:
        raise ConfigError(f"the model mixes formats ({', '.join(sorted(k.__name__ for k in kinds))}); write one at a time")
    kind = kinds.pop()
    first = next(iter(quantized.values()))
    fmt, args = _SCHEMES[kind] if not w4a8 else _W4AFP8
    weights, acts = args(first)
    for name, w in quantized.items():
        if args(w) != (weights, acts):
            raise ConfigError(f"{name} is quantized with other settings than the rest of the model")
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                      "output_activations": None, "format": fmt}},
        "ignore": plain,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
    }


def write_compressed_tensors_folder(model: Transformer, args: ModelArgs, tokenizer_path: Path, out: Path,
                                    w4a8: bool = False, max_shard_bytes: int = 4 << 30) -> None:
    """Write ``model`` (whole, world size 1) to the folder ``out``: config.json with
    ``quantization_config``, ``model-NNNNN-of-NNNNN.safetensors`` shards with their index, tokenizer.
    ``w4a8``: the model holds int4 weights, to be written as W4AFP8 (see the module's notes)."""
    from safetensors.torch import save_file

    from llama_lite.synthetic import hf_config

    tensors, quantized, plain = hf_tensors(model, w4a8)
    config = hf_config(args)
    config["quantization_config"] = quantization_config(quantized, plain, w4a8)
    shards: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        save_file({k: v.contiguous() for k, v in shard.items()}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copyfile(tokenizer_path, out / "tokenizer.model")
