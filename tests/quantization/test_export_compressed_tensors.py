"""scripts.quantize --format compressed-tensors: compressed-tensors' own decompression of the folder
is the weights llama-lite computes with, and llama-lite loads it back to the logits of its own format."""

import json

import pytest
import torch

pytest.importorskip("compressed_tensors")

from hf_quantized import decompressed_state_dict  # noqa: E402
from kernels.formats import dequantize_weight, select_expert  # noqa: E402
from llama_lite.errors import ConfigError  # noqa: E402
from quantization import build  # noqa: E402
from scripts.quantize import quantize  # noqa: E402

MODES = {"int4_mixed": "pack-quantized", "fp8_mixed": "float-quantized", "nvfp4": "nvfp4-pack-quantized",
         "w4a8": "int-quantized"}
TOKENS = torch.randint(0, 200000, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def written(ckpt_root, tiny_ckpt_hf, dist1):
    """mode -> (compressed-tensors folder, llama-lite folder) of the tiny preset."""

    def make(mode):
        ct, own = ckpt_root / f"export-ct-{mode}", ckpt_root / f"export-own-{mode}"
        if not ct.exists():
            quantize(str(tiny_ckpt_hf), str(ct), mode, world_size=1, format="compressed-tensors")
            quantize(str(tiny_ckpt_hf), str(own), mode, world_size=1)
        return ct, own

    return make


def _linear_weights(model):
    """HF module name -> every quantized 2-D weight of a llama-lite model (experts one by one)."""
    out = {}
    for i, block in enumerate(model.layers):
        ff = block.feed_forward
        for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            w = getattr(ff.experts, ours)
            if not isinstance(w, torch.Tensor):
                for e in range(ff.experts.num_experts):
                    out[f"model.layers.{i}.feed_forward.experts.{e}.{theirs}"] = select_expert(w, e)
            w = getattr(ff.shared_expert, ours)
            if not isinstance(w, torch.nn.Module) and not isinstance(w, torch.Tensor):
                out[f"model.layers.{i}.feed_forward.shared_expert.{theirs}"] = w
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_round_trip(mode, written, dist1):
    ct, own = written(mode)
    cfg = json.loads((ct / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == MODES[mode]
    assert sorted(p.name for p in ct.iterdir()) == ["config.json", "model.safetensors", "tokenizer.model"]
    kw = dict(max_seq_len=64, max_batch_size=2, progress=False, dtype=torch.float32)
    ours = build(own, mode, **kw).model
    back = build(ct, **kw)  # the mode comes from the folder
    assert back.quantization_mode == mode
    assert torch.equal(back.model(TOKENS, 0), ours(TOKENS, 0))
    # compressed-tensors decompresses to its scales' dtype (bf16 for int4 and nvfp4, fp32 for fp8);
    # llama-lite's fp32 products of values and scales, rounded once to that dtype, are its numbers.
    # w4a8 is stored as the int4 weights its fp8 and channel scales are derived from.
    reference = decompressed_state_dict(ct)
    weights = _linear_weights(ours if mode != "w4a8" else build(written("int4_mixed")[1], "int4_mixed", **kw).model)
    assert len(weights) == {"int4_mixed": 48 + 12, "fp8_mixed": 24, "nvfp4": 48 + 12, "w4a8": 48 + 12}[mode]
    for name, w in weights.items():
        theirs = reference[f"{name}.weight"]
        assert torch.equal(dequantize_weight(w).to(theirs.dtype), theirs), name
    ignored = cfg["quantization_config"]["ignore"]
    assert "lm_head" in ignored and "model.layers.0.feed_forward.router" in ignored
    if mode == "fp8_mixed":  # the first and last layers' experts stay bf16, one Linear per expert
        assert "model.layers.0.feed_forward.experts.3.down_proj" in ignored


def test_refused_outputs(tiny_ckpt_hf, tmp_path, dist1):
    with pytest.raises(ConfigError, match="unknown --format 'gguf'"):
        quantize(str(tiny_ckpt_hf), str(tmp_path / "g"), "int4_mixed", world_size=1, format="gguf")
    assert not (tmp_path / "g").exists()
