"""compressed-tensors folders (llm-compressor's per-expert layout) load without a flag and give the
logits of transformers on compressed-tensors' own decompression of the same folder.

The folders are written by compressed-tensors' compressors from the tiny preset's Hugging Face
export (see tests/hf_quantized.py). Both sides run in fp32, so what remains of the weight-only
schemes is the bf16 rounding of compressed-tensors' dequantized weights (llama-lite multiplies
values and scales in fp32). The activation-quantized schemes differ from a weight-only reference
by their activation quantization; they must still be nearer to it than to the bf16 model.
"""

import json

import pytest
import torch

pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")

from hf_quantized import decompressed_state_dict, edited_copy, fused, transformers_logits, write_compressed_tensors  # noqa: E402
from kernels.formats import Fp8Weight, Int4Weight, NVFP4Weight, W4A8Weight, dequantize_weight  # noqa: E402
from llama_lite.errors import CheckpointError, ConfigError  # noqa: E402
from llama_lite.generation import Llama4  # noqa: E402
from quantization import build  # noqa: E402
from quantization.modules import QuantizedExperts, QuantizedFeedForward, QuantizedLinear  # noqa: E402

TOKENS = torch.randint(0, 200000, (2, 24), generator=torch.Generator().manual_seed(0))
IGNORE = ["lm_head", "re:.*router"]
# One exact module name too: a shared expert whose down projection stays bf16 in a quantized FFN.
IGNORE_W4A16 = IGNORE + ["model.layers.3.feed_forward.shared_expert.down_proj"]

# scheme -> (llama-lite mode, container, bound on the relative RMS logit error against the reference)
SCHEMES = {
    "W4A16": ("int4_mixed", Int4Weight, 0.01),
    "NVFP4A16": ("nvfp4", NVFP4Weight, 0.01),
    "FP8_DYNAMIC": ("fp8_mixed", Fp8Weight, 0.12),
    "W4AFP8": ("w4a8", W4A8Weight, 0.12),
    "NVFP4": ("nvfp4", NVFP4Weight, 0.25),
}


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


@pytest.fixture(scope="session")
def ct_folder(ckpt_root, tiny_ckpt_hf):
    def make(scheme: str):
        ignore = IGNORE_W4A16 if scheme == "W4A16" else IGNORE
        return write_compressed_tensors(tiny_ckpt_hf, ckpt_root / f"ct-{scheme}", scheme, ignore)

    return make


@pytest.fixture(scope="session")
def bf16_logits(tiny_ckpt_hf):
    from safetensors.torch import load_file

    cfg = json.loads((tiny_ckpt_hf / "config.json").read_text())
    return transformers_logits(cfg, load_file(str(tiny_ckpt_hf / "model.safetensors")), TOKENS, torch.float32)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_logits_match_transformers_on_the_decompressed_folder(scheme, ct_folder, bf16_logits, dist1):
    folder = ct_folder(scheme)
    mode, container, bound = SCHEMES[scheme]
    llama = build(folder, max_seq_len=64, max_batch_size=2, progress=False, dtype=torch.float32)  # no mode given
    assert llama.quantization_mode == mode
    model = llama.model
    assert isinstance(model.layers[0].feed_forward.experts, QuantizedExperts)
    assert isinstance(model.layers[0].feed_forward.experts.w1, container)
    assert isinstance(model.layers[1].attention.wq, QuantizedLinear)  # "Linear" targets attention too
    assert not isinstance(model.output, QuantizedLinear)  # lm_head is ignored
    got = model(TOKENS, 0)
    cfg = json.loads((folder / "config.json").read_text())
    want = transformers_logits(cfg, fused(decompressed_state_dict(folder)), TOKENS, torch.float32)
    err, to_bf16 = rel_rms(got, want), rel_rms(got, bf16_logits)
    assert err <= bound, err
    assert err < to_bf16, (err, to_bf16)  # nearer to the quantized model than to the bf16 original
    if bound <= 0.01:
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    if scheme == "W4AFP8":
        return  # its fp8 group and channel scales are derived from the stored bf16 ones
    # The weights, bit for bit, up to compressed-tensors' rounding of its dequantized weight to its
    # scales' dtype (bf16 here; llama-lite's fp32 products of values and scales are exact).
    reference = decompressed_state_dict(folder)
    experts = model.layers[2].feed_forward.experts
    for e in range(experts.num_experts):
        for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            ref = reference[f"model.layers.2.feed_forward.experts.{e}.{theirs}.weight"]
            assert torch.equal(dequantize_weight(getattr(experts, ours))[e].to(ref.dtype), ref)
    ref = reference["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(dequantize_weight(model.layers[1].attention.wk.weight).to(ref.dtype), ref)
    if scheme == "W4A16":  # an ignored module stays bf16 inside a quantized FFN
        ffn = model.layers[3].feed_forward.shared_expert
        assert isinstance(ffn, QuantizedFeedForward) and isinstance(ffn.w1, Int4Weight)
        assert isinstance(ffn.w2, torch.Tensor) and ffn.w2.dtype == torch.float32  # the run's dtype
        assert isinstance(model.layers[2].feed_forward.shared_expert.w2, Int4Weight)


def test_mode_conflicts_and_the_core_loader(ct_folder, dist1):
    folder = ct_folder("W4A16")
    with pytest.raises(ConfigError, match="runs as int4_mixed; --quantization_mode fp8_mixed conflicts"):
        build(folder, "fp8_mixed", max_seq_len=32, max_batch_size=1, progress=False)
    with pytest.raises(CheckpointError, match="holds quantized weights \\(compressed-tensors\\)"):
        Llama4.build(folder, max_seq_len=32, max_batch_size=1)
    llama = build(folder, "w4a8", max_seq_len=32, max_batch_size=1, progress=False)  # derived from int4 scales
    assert isinstance(llama.model.layers[0].feed_forward.experts.w1, W4A8Weight)


def _regex_groups(q):
    """The same W4A16 numbers described by two config groups with "re:" targets and a regex ignore."""
    g = q["config_groups"]["group_0"]
    q["config_groups"] = {
        "experts": {**g, "targets": [r"re:.*feed_forward\.experts\.\d+\..*"]},
        "dense": {**g, "targets": [r"re:.*self_attn\..*_proj$", r"re:.*shared_expert\.(gate|up|down)_proj$"]},
    }
    q["ignore"] = ["lm_head", "re:.*router$", "model.layers.3.feed_forward.shared_expert.down_proj"]
    q["format"] = "mixed-precision"


def test_regex_targets_and_several_groups(ct_folder, ckpt_root, dist1):
    folder = ct_folder("W4A16")
    regex = edited_copy(folder, ckpt_root / "ct-regex-groups", config=_regex_groups)
    kw = dict(max_seq_len=32, max_batch_size=1, progress=False, dtype=torch.float32)
    tokens = TOKENS[:1, :12]
    a, b = build(folder, **kw).model, build(regex, **kw).model
    assert isinstance(b.layers[3].feed_forward.shared_expert.w2, torch.Tensor)
    assert torch.equal(a(tokens, 0), b(tokens, 0))


def _multimodal(sd):
    for k in list(sd):
        sd["language_model." + k] = sd.pop(k)


def test_multimodal_prefixes(ct_folder, ckpt_root, dist1):
    """Llama4ForConditionalGeneration's folders name the text model language_model.*, ignore lists too."""
    folder = ct_folder("NVFP4A16")
    mm = edited_copy(folder, ckpt_root / "ct-multimodal", edit=_multimodal)
    cfg = json.loads((mm / "config.json").read_text())
    q = cfg.pop("quantization_config")
    q["ignore"] = ["language_model." + n for n in q["ignore"]]
    wrapped = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": cfg,
               "quantization_config": q}
    (mm / "config.json").write_text(json.dumps(wrapped))
    kw = dict(max_seq_len=32, max_batch_size=1, progress=False, dtype=torch.float32)
    tokens = TOKENS[:1, :12]
    assert torch.equal(build(folder, **kw).model(tokens, 0), build(mm, **kw).model(tokens, 0))


def _asym(q):
    q["config_groups"]["group_0"]["weights"]["symmetric"] = False


def _block_fp8(q):
    w = q["config_groups"]["group_0"]["weights"]
    w["strategy"], w["block_structure"] = "block", [64, 64]


def _static_acts(q):
    q["config_groups"]["group_0"]["input_activations"]["dynamic"] = False


def _gptq(q):
    q["quant_method"] = "gptq"


EXPERT = "model.layers.1.feed_forward.experts.2.up_proj"
BAD = {
    # scheme, how the folder is spoiled, what the one line says
    "asymmetric_int4": ("W4A16", None, _asym, "asymmetric int4 weights"),
    "block_fp8": ("FP8_DYNAMIC", None, _block_fp8, "fp8 weights map onto llama-lite's fp8 rowwise format only"),
    "static_activations": ("FP8_DYNAMIC", None, _static_acts, "dynamic per-token fp8 activations only"),
    "other_method": ("W4A16", None, _gptq, "quant_method 'gptq', which llama-lite cannot load"),
    "missing_scale": ("W4A16", lambda sd: sd.pop(f"{EXPERT}.weight_scale"), None, f"lacks {EXPERT}.weight_scale"),
    "wrong_scale_shape": ("NVFP4A16", lambda sd: sd.__setitem__(f"{EXPERT}.weight_scale", sd[f"{EXPERT}.weight_scale"][:, :4].contiguous()),
                          None, f"{EXPERT}.weight_scale (shape (256, 4)"),
    "missing_expert": ("W4A16", lambda sd: [sd.pop(k) for k in list(sd) if k.startswith(EXPERT + ".")], None,
                       "lacks expert 2 of layers.1.feed_forward.experts.w3"),
}


@pytest.fixture(scope="session")
def bad_folder(ct_folder, ckpt_root):
    def make(case):
        scheme, edit, config, _ = BAD[case]
        dst = ckpt_root / f"ct-bad-{case}"
        return dst if dst.exists() else edited_copy(ct_folder(scheme), dst, edit, config)

    return make


@pytest.mark.parametrize("case", list(BAD))
def test_bad_folders_raise_one_named_sentence(case, bad_folder, dist1):
    with pytest.raises((CheckpointError, ConfigError)) as info:
        build(bad_folder(case), max_seq_len=32, max_batch_size=1, progress=False)
    assert BAD[case][3] in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("case", ["asymmetric_int4"])
def test_scripts_print_one_line_and_exit_2(case, bad_folder, run_script):
    result = run_script("scripts.completion", bad_folder(case), "--prompt", "hi", "--max_gen_len", "2", timeout=180)
    assert result.returncode == 2, (result.stdout, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    assert BAD[case][3] in lines[0], lines[0]


def test_two_ranks_give_the_logits_of_one(ct_folder, tmp_path, dist1):
    """Resharding: the folder is written whole; two ranks each take their slice of every weight."""
    from helpers import worker_results

    folder = ct_folder("NVFP4A16")
    two = worker_results(tmp_path, folder, "none", 2)["none"]  # the worker's tokens, fp32
    tokens = torch.randint(0, 200000, (2, 12), generator=torch.Generator().manual_seed(0))
    one = build(folder, max_seq_len=64, max_batch_size=2, progress=False, dtype=torch.float32)
    assert (two["logits"] - one.model(tokens, 0)).abs().max().item() <= 1e-3
    assert two["greedy"] == one.generate_tokens([[200000, 10, 20, 30], [200000, 5]], temperature=0, max_gen_len=12,
                                                stop_tokens=[])
