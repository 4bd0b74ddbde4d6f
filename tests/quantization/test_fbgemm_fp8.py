"""fbgemm_fp8 folders (transformers' layout of Meta's FP8 Maverick) load as fp8_mixed without a flag.

The folder is written from the tiny preset's Hugging Face export in the layout transformers' own
fbgemm_fp8 integration gives Llama4ForCausalLM (checked against its module replacement), with
the modules fp8_mixed leaves in bf16 named in ``modules_to_not_convert``: it then holds exactly
the numbers of llama-lite's fp8_mixed of the bf16 original.
"""

import json

import pytest
import torch

pytest.importorskip("transformers")

from hf_quantized import edited_copy, write_fbgemm_fp8  # noqa: E402
from kernels.formats import Fp8Weight  # noqa: E402
from llama_lite.errors import CheckpointError, ConfigError  # noqa: E402
from quantization import build  # noqa: E402

TOKENS = torch.randint(0, 200000, (2, 24), generator=torch.Generator().manual_seed(0))
# fp8_mixed's choice: routed experts only, and not those of the first and last layer (tiny: 4 layers).
NOT_CONVERTED = [
    "lm_head",
    r"model\.layers\.\d+\.self_attn",
    r"model\.layers\.\d+\.feed_forward\.shared_expert",
    r"model\.layers\.\d+\.feed_forward\.router",
    "model.layers.0.feed_forward.experts",
    "model.layers.3.feed_forward.experts",
]


@pytest.fixture(scope="session")
def fbgemm_folder(ckpt_root, tiny_ckpt_hf):
    return write_fbgemm_fp8(tiny_ckpt_hf, ckpt_root / "fbgemm-fp8", NOT_CONVERTED)


def test_loads_as_fp8_mixed_with_the_numbers_of_fp8_mixed(fbgemm_folder, tiny_ckpt_hf, dist1):
    kw = dict(max_seq_len=64, max_batch_size=2, progress=False, dtype=torch.float32)
    ours = build(fbgemm_folder, **kw)  # no mode given
    assert ours.quantization_mode == "fp8_mixed"
    ref = build(tiny_ckpt_hf, "fp8_mixed", **kw)
    for i in range(4):
        a, b = ours.model.layers[i].feed_forward.experts, ref.model.layers[i].feed_forward.experts
        if i in (0, 3):
            assert not isinstance(getattr(a, "w1", None), Fp8Weight) and torch.equal(a.w1, b.w1)
            continue
        for w in ("w1", "w3", "w2"):
            wa, wb = getattr(a, w), getattr(b, w)
            assert torch.equal(wa.weight.view(torch.uint8), wb.weight.view(torch.uint8)), (i, w)
            assert torch.equal(wa.scale, wb.scale) and wa.activation_scale_ub == wb.activation_scale_ub == 1200.0
    assert torch.equal(ours.model(TOKENS, 0), ref.model(TOKENS, 0))


def _router_converted(q):
    q["modules_to_not_convert"] = [p for p in q["modules_to_not_convert"] if "router" not in p]


def _experts_not_converted(q):
    q["modules_to_not_convert"].append("model.layers.1.feed_forward.experts")


BAD = {
    "missing_scale": (lambda sd: sd.pop("model.layers.2.feed_forward.experts.down_proj_scale"), None,
                      "lacks model.layers.2.feed_forward.experts.down_proj_scale"),
    "wrong_scale_shape": (lambda sd: sd.__setitem__("model.layers.1.feed_forward.experts.gate_up_proj_scale",
                                                    torch.ones(4, 512)), None,
                          "gate_up_proj_scale has shape (4, 512); fbgemm_fp8 needs (4, 1, 512)"),
    "router_converted": (None, _router_converted, "leaves the router model.layers.0.feed_forward.router to fp8"),
    "config_disagrees": (None, _experts_not_converted,
                         "stores model.layers.1.feed_forward.experts in fp8 although modules_to_not_convert names it"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_folders_raise_one_named_sentence(case, fbgemm_folder, ckpt_root, dist1):
    edit, config, phrase = BAD[case]
    folder = edited_copy(fbgemm_folder, ckpt_root / f"fbgemm-bad-{case}", edit, config)
    with pytest.raises(CheckpointError) as info:
        build(folder, max_seq_len=32, max_batch_size=1, progress=False)
    assert phrase in str(info.value), str(info.value)


def test_another_mode_is_refused(fbgemm_folder, dist1):
    with pytest.raises(ConfigError, match="fbgemm_fp8 checkpoint that runs as fp8_mixed; --quantization_mode int4_mixed"):
        build(fbgemm_folder, "int4_mixed", max_seq_len=32, max_batch_size=1, progress=False)
    assert json.loads((fbgemm_folder / "config.json").read_text())["quantization_config"]["quant_method"] == "fbgemm_fp8"
