"""The vision tower under tensor parallelism and resharding, with quantization modes, and the text
model of a multimodal checkpoint left as it is for text-only dialogs."""

from pathlib import Path

import pytest
import torch

from helpers import make_checkpoint
from llama_lite.chat_format import RawMessage
from llama_lite.generation import Llama4
from llama_lite.synthetic import VISION_ARGS
from llama_lite.vision import VisionEmbeddings

WORKER = Path(__file__).resolve().parent / "workers" / "vision_worker.py"
OVERRIDES = dict(vision_args=VISION_ARGS, attn_temperature_tuning=False)


def load_worker():
    import importlib.util

    spec = importlib.util.spec_from_file_location("vision_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def vision_ckpt(ckpt_root):
    return make_checkpoint(ckpt_root, "vision-meta", preset="tiny", seed=5, overrides=OVERRIDES)


@pytest.fixture(scope="module")
def one_process(vision_ckpt, dist1):
    llama = Llama4.build(vision_ckpt, max_seq_len=256, max_batch_size=1, dtype=torch.float32)
    return load_worker().probe(llama)


@pytest.mark.slow
def test_world_size_2_equals_one_process(run_torchrun, vision_ckpt, one_process, tmp_path):
    out = tmp_path / "w2.pt"
    got = run_torchrun(2, WORKER, vision_ckpt, out)
    assert got.returncode == 0, got.stderr[-3000:]
    two = torch.load(out, weights_only=True)
    assert two["world_size"] == 2
    err = (two["logits"] - one_process["logits"]).norm() / one_process["logits"].norm()
    assert err.item() <= 1e-5
    assert two["reply"] == one_process["reply"]


def test_two_shards_on_one_process_equal_one_shard(ckpt_root, one_process, dist1):
    mp2 = make_checkpoint(ckpt_root, "vision-meta-mp2", preset="tiny", seed=5, mp=2, overrides=OVERRIDES)
    result = load_worker().probe(Llama4.build(mp2, max_seq_len=256, max_batch_size=1, dtype=torch.float32))
    assert torch.equal(result["logits"], one_process["logits"])
    assert result["reply"] == one_process["reply"]


def test_quantization_leaves_the_vision_tower_in_bf16(vision_ckpt, tmp_path, dist1):
    import quantization
    from scripts.quantize import quantize

    bf16 = Llama4.build(vision_ckpt, max_seq_len=256, max_batch_size=1)
    tiles = torch.randn(5, 3, 56, 56, generator=torch.Generator().manual_seed(0))
    want = bf16.model.encode_images(tiles)
    out = tmp_path / "int4"
    quantize(ckpt_dir=str(vision_ckpt), output_dir=str(out), quantization_mode="int4_mixed")
    for source in (vision_ckpt, out):  # on the fly, and the pre-quantized folder
        q = quantization.build(source, "int4_mixed", max_seq_len=256, max_batch_size=1, progress=False)
        tower = [q.model.vision_embeddings, q.model.vision_projection]
        assert isinstance(tower[0], VisionEmbeddings)
        assert all(p.dtype == torch.bfloat16 for m in tower for p in m.parameters())
        assert torch.equal(q.model.encode_images(tiles), want)
        assert type(q.model.layers[0].feed_forward.experts).__name__ != "Experts"  # the experts were quantized
        dialog = load_worker().image_dialog()
        assert q.generate_tokens([q.formatter.encode_dialog(dialog).tokens],
                                 images=[[t.tiles for t in q.formatter.encode_dialog(dialog).images]],
                                 temperature=0, max_gen_len=3, stop_tokens=[])[0]


def test_text_dialogs_do_not_see_the_vision_tower(ckpt_root, vision_ckpt, dist1):
    text_only = make_checkpoint(ckpt_root, "vision-meta-text-twin", preset="tiny", seed=5,
                                overrides=dict(attn_temperature_tuning=False))
    dialog = [RawMessage(role="user", content="What is the recipe of mayonnaise?")]
    a, b = (Llama4.build(p, max_seq_len=64, max_batch_size=1) for p in (vision_ckpt, text_only))
    tokens = torch.tensor([a.formatter.encode_dialog_prompt(dialog)])
    assert a.formatter.encode_dialog_prompt(dialog) == b.formatter.encode_dialog_prompt(dialog)
    assert torch.equal(a.model(tokens, 0), b.model(tokens, 0))
