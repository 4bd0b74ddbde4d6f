"""Hugging Face quantized folders built from a bf16 Hugging Face export, and their reference numbers.

compressed-tensors folders are written by compressed-tensors itself: its schemes are applied to
a module tree of the model in llm-compressor's per-expert layout (one Linear per expert and
projection), weight scales come from a min-max reduction as llm-compressor's observer computes
them (handed to compressed-tensors' ``calculate_qparams`` / ``generate_gparam``), and its
``ModelCompressor`` compresses and writes ``quantization_config``. The reference weights are
compressed-tensors' own decompression of the folder; the reference logits are transformers'
Llama4ForCausalLM on those weights.
"""

import json
import shutil
from pathlib import Path

import torch
from torch import nn


def per_expert(sd: dict) -> dict:
    """Hugging Face names with the fused experts split into one Linear weight per expert."""
    out = {}
    for k, t in sd.items():
        if k.endswith("experts.gate_up_proj"):
            p, f = k[: -len("gate_up_proj")], t.shape[-1] // 2
            for e in range(t.shape[0]):
                out[f"{p}{e}.gate_proj.weight"] = t[e, :, :f].t().contiguous()
                out[f"{p}{e}.up_proj.weight"] = t[e, :, f:].t().contiguous()
        elif k.endswith("experts.down_proj"):
            p = k[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = t[e].t().contiguous()
        else:
            out[k] = t
    return out


def fused(sd: dict) -> dict:
    """The inverse of ``per_expert``: transformers' Llama4 names and layout."""
    out, experts = {}, {}
    for k, t in sd.items():
        parts = k.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            prefix, e, proj = ".".join(parts[: i + 1]), int(parts[i + 1]), parts[i + 2]
            experts.setdefault(prefix, {}).setdefault(proj, {})[e] = t
        else:
            out[k] = t
    for prefix, projs in experts.items():
        n = len(projs["gate_proj"])
        gate = torch.stack([projs["gate_proj"][e].t() for e in range(n)])
        up = torch.stack([projs["up_proj"][e].t() for e in range(n)])
        out[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=-1).contiguous()
        out[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e].t() for e in range(n)]).contiguous()
    return out


def module_tree(sd: dict) -> nn.Module:
    """nn.Modules at the dotted paths of ``sd``: a Linear wherever a 2-D ``weight`` sits (but the
    embeddings), plain parameters elsewhere."""
    root = nn.Module()
    for name, t in sd.items():
        path, _, pname = name.rpartition(".")
        parent = root
        parts = path.split(".") if path else []
        for i, part in enumerate(parts):
            if not hasattr(parent, part):
                leaf = i == len(parts) - 1
                linear = leaf and pname == "weight" and t.dim() == 2 and part != "embed_tokens"
                parent.add_module(part, nn.Linear(t.shape[1], t.shape[0], bias=False, device="meta") if linear else nn.Module())
            parent = getattr(parent, part)
        setattr(parent, pname, nn.Parameter(t.clone(), requires_grad=False))
    return root


def _minmax(w: torch.Tensor, args):
    strategy = str(args.strategy.value if hasattr(args.strategy, "value") else args.strategy)
    if strategy == "tensor":
        return torch.aminmax(w)
    if strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    g = w.unflatten(-1, (-1, args.group_size))
    return g.amin(-1), g.amax(-1)


def write_compressed_tensors(src: Path, out: Path, scheme: str, ignore: list, input_amax: float = 4.0) -> Path:
    """A compressed-tensors folder of the bf16 Hugging Face export ``src`` in per-expert layout.

    ``scheme``: a compressed-tensors preset (W4A16, W4AFP8, FP8_DYNAMIC, NVFP4A16, NVFP4) applied
    to every Linear but ``ignore``. For NVFP4's static activation global scale (calibrated in
    llm-compressor), ``input_amax`` stands in for the calibrated activation maximum.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from safetensors.torch import load_file, save_file

    if out.exists():
        return out
    tree = module_tree(per_expert(load_file(str(src / "model.safetensors"))))
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])}, ignore=ignore)
    apply_quantization_config(tree, config, show_progress=False)
    with torch.no_grad():
        for _, m in tree.named_modules():
            s = getattr(m, "quantization_scheme", None)
            if s is None:
                continue
            args, w = s.weights, m.weight
            g = None
            if hasattr(m, "weight_global_scale"):
                g = generate_gparam(w.min(), w.max())
                m.weight_global_scale.copy_(g.to(m.weight_global_scale.dtype))
            lo, hi = _minmax(w, args)
            scale, zp = calculate_qparams(lo, hi, args, global_scale=g)
            m.weight_scale.copy_(scale.reshape(m.weight_scale.shape).to(m.weight_scale.dtype))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.copy_(zp.reshape(m.weight_zero_point.shape).to(m.weight_zero_point.dtype))
            if hasattr(m, "input_global_scale"):
                gi = generate_gparam(torch.tensor(-input_amax), torch.tensor(input_amax))
                m.input_global_scale.copy_(gi.to(m.input_global_scale.dtype))
    compressor = ModelCompressor.from_pretrained_model(tree)
    compressor.compress_model(tree)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tree.state_dict().items()}, str(tmp / "model.safetensors"))
    shutil.copyfile(src / "config.json", tmp / "config.json")
    shutil.copyfile(src / "tokenizer.model", tmp / "tokenizer.model")
    compressor.update_config(str(tmp))
    tmp.rename(out)
    return out


def decompressed_state_dict(folder: Path) -> dict:
    """compressed-tensors' decompression of a folder: dense bf16 weights under the stored names
    (as transformers' ``run_compressed=False`` load does, module by module)."""
    from compressed_tensors.compressors.base import decompress_module
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.utils import replace_direct_state_dict
    from safetensors.torch import load_file

    stored = load_file(str(folder / "model.safetensors"))
    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    by_module: dict[str, dict] = {}
    for k, t in stored.items():
        module, _, p = k.rpartition(".")
        by_module.setdefault(module, {})[p] = t
    shapes = {}  # dense shape of every quantized module
    for module, params in by_module.items():
        if "weight_scale" not in params:
            continue
        if "weight_shape" in params:
            shapes[module] = tuple(params["weight_shape"].tolist())
        elif "weight_packed" in params:
            shapes[module] = (params["weight_packed"].shape[0], params["weight_packed"].shape[1] * 2)
        else:
            shapes[module] = tuple(params["weight"].shape)
    skeleton = {k: t for k, t in stored.items() if k.rpartition(".")[0] not in shapes}
    skeleton.update({f"{m}.weight": torch.zeros(shape, dtype=torch.bfloat16) for m, shape in shapes.items()})
    tree = module_tree(skeleton)
    apply_quantization_config(tree, QuantizationConfig.model_validate(qcfg), show_progress=False)
    out = {k: t for k, t in stored.items() if k.rpartition(".")[0] not in shapes}
    for name, m in tree.named_modules():
        if getattr(m, "quantization_scheme", None) is not None:
            assert name in shapes, f"{name} is covered by the config but not stored quantized"
            replace_direct_state_dict(m, dict(by_module[name]))
            decompress_module(m)
            out[f"{name}.weight"] = m.weight.detach().clone()
    return out


def transformers_logits(config_json: dict, sd: dict, tokens: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """transformers' Llama4ForCausalLM (in ``dtype``) on the Hugging Face state dict ``sd``."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(**{k: v for k, v in config_json.items()
                              if k not in ("architectures", "model_type", "torch_dtype", "quantization_config")})
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = Llama4ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=False)
    assert not missing and not unexpected, (missing[:3], unexpected[:3])
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits.float()


def fp8_per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fbgemm's quantize_fp8_per_row on [..., N, K]: (e4m3 values, fp32 scale = row amax / 448)."""
    wf = w.float()
    scale = wf.abs().amax(-1, keepdim=True) / 448.0
    q = (wf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale


def fbgemm_layout(config_json: dict, modules_to_not_convert: list) -> dict:
    """Name -> (shape, dtype) of every tensor transformers' fbgemm_fp8 integration gives
    Llama4ForCausalLM (modules replaced by its own ``replace_with_fbgemm_fp8_linear``)."""
    from unittest import mock

    import transformers.integrations.fbgemm_fp8 as fb
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(**{k: v for k, v in config_json.items() if k not in ("architectures", "model_type", "torch_dtype")})
    with torch.device("meta"):
        model = Llama4ForCausalLM(cfg)
    # its per-row quantizer is a CUDA op of fbgemm-gpu and its empty init comes from accelerate;
    # only the module layout is wanted here
    with mock.patch.object(fb, "get_quantize_fp8_per_row", lambda: None), \
            mock.patch.object(fb, "init_empty_weights", lambda include_buffers=True: torch.device("meta"), create=True):
        fb.replace_with_fbgemm_fp8_linear(model, modules_to_not_convert=modules_to_not_convert, pre_quantized=True)
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def write_fbgemm_fp8(src: Path, out: Path, modules_to_not_convert: list, activation_scale_ub: float = 1200.0) -> Path:
    """An fbgemm_fp8 folder of the bf16 export ``src``: every Linear and fused expert block that
    transformers would convert, quantized per output channel as fbgemm's quantize_fp8_per_row does."""
    from safetensors.torch import load_file, save_file

    if out.exists():
        return out
    config = json.loads((src / "config.json").read_text())
    layout = fbgemm_layout(config, modules_to_not_convert)
    sd = load_file(str(src / "model.safetensors"))
    tensors = {}
    for name, t in sd.items():
        if name.endswith("experts.gate_up_proj") and layout[name][1] == torch.float8_e4m3fn:
            q, s = fp8_per_row(t.transpose(1, 2))  # one scale per output column: [E, 2F, D]
            tensors[name], tensors[name + "_scale"] = q.transpose(1, 2).contiguous(), s.transpose(1, 2).contiguous()
        elif name.endswith("experts.down_proj") and layout[name][1] == torch.float8_e4m3fn:
            q, s = fp8_per_row(t.transpose(1, 2))  # [E, D, F]
            tensors[name], tensors[name + "_scale"] = q.transpose(1, 2).contiguous(), s.contiguous()
        elif name.endswith(".weight") and f"{name}_scale" in layout:
            tensors[name], tensors[name + "_scale"] = fp8_per_row(t)
        else:
            tensors[name] = t
    for name, t in tensors.items():  # transformers' names and shapes; its dtypes where quantized
        quantized = layout[name][1] == torch.float8_e4m3fn or name.endswith("_scale")
        assert layout[name][0] == tuple(t.shape) and (not quantized or layout[name][1] == t.dtype), (name, layout[name])
    assert set(layout) == set(tensors), sorted(set(layout) ^ set(tensors))[:5]
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"))
    config["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": activation_scale_ub,
                                     "modules_to_not_convert": modules_to_not_convert}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copyfile(src / "tokenizer.model", tmp / "tokenizer.model")
    tmp.rename(out)
    return out


def edited_copy(src, dst, edit=None, config=None):
    """A copy of a folder with its tensors (and config) changed."""
    from safetensors.torch import load_file, save_file

    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir()
    if edit:
        sd = load_file(str(src / "model.safetensors"))
        edit(sd)
        save_file(sd, str(dst / "model.safetensors"))
    else:
        (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    if config:
        config(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    shutil.copyfile(src / "tokenizer.model", dst / "tokenizer.model")
    return dst
