"""Checkpoint reading: Meta's fused keys, resharding between MP sizes, params.json / config.json, Meta's
hidden-size rules (against llama-models' own modules), Hugging Face names and multimodal prefixes."""

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llama_lite.args import ModelArgs, MoEArgs, VisionArgs
from llama_lite.checkpoint import Checkpoint, _meta_shard_index, read_model_args
from llama_lite.model import Transformer
from llama_lite.synthetic import (
    VISION_ARGS,
    hf_config,
    hf_vision_config,
    preset_args,
    random_state_dict,
    shard_state_dict,
    to_hf_keys,
    to_meta_keys,
)


@pytest.fixture(scope="module")
def tiny_args() -> ModelArgs:
    return preset_args("tiny")


@pytest.fixture(scope="module")
def tiny_sd(tiny_args) -> dict[str, torch.Tensor]:
    """The unsharded weights every tiny checkpoint of seed 0 was written from."""
    return random_state_dict(tiny_args, seed=0)


def engine_names(args: ModelArgs) -> list[str]:
    with torch.device("meta"):
        return [name for name, _ in Transformer(args).named_parameters()]


def assert_same_tensors(ckpt: Checkpoint, expected: dict[str, torch.Tensor]) -> None:
    assert sorted(ckpt.keys()) == sorted(expected)
    for name, want in expected.items():
        got = ckpt.get(name)
        assert got.shape == want.shape, name
        assert torch.equal(got, want), name


# --- Meta's fused keys ----------------------------------------------------------------------
def test_meta_files_hold_fused_keys_and_read_back_under_engine_names(tiny_ckpt, tiny_args, tiny_sd, dist1):
    raw = torch.load(tiny_ckpt / "consolidated.00.pth", map_location="cpu", mmap=True, weights_only=True)
    for fused in ("layers.0.attention.wqkv.weight", "layers.0.attention.wqkv.layer_norm_weight",
                  "layers.0.feed_forward.norm.weight", "layers.0.feed_forward.experts.moe_w_in_eD_F",
                  "layers.0.feed_forward.experts.moe_w_swiglu_eD_F", "layers.0.feed_forward.experts.moe_w_out_eF_D",
                  "layers.0.feed_forward.w_in_shared_FD.weight", "layers.0.feed_forward.w_out_shared_DF.weight"):
        assert fused in raw, fused
    assert "layers.0.attention.wq.weight" not in raw
    # Written in place after torch.save(skip_data): still a valid zip, every record's CRC-32 right.
    with zipfile.ZipFile(tiny_ckpt / "consolidated.00.pth") as zf:
        assert zf.testzip() is None
    assert sorted(tiny_sd) == sorted(engine_names(tiny_args))
    assert_same_tensors(Checkpoint(tiny_ckpt, tiny_args), tiny_sd)


@pytest.mark.parametrize("mp", [1, 2])
def test_dense_and_moe_layers_round_trip_through_meta_keys(mp, dist1):
    """A model with dense layers too (tiny has only MoE layers): fc1 = [w1; w3], mlp.layer_norm_weight."""
    args = preset_args("tiny", n_layers=2, moe_args=dict(num_experts=4, top_k=1, interleave_moe_layer_step=2))
    sd = random_state_dict(args, seed=1)
    assert "layers.0.feed_forward.w1.weight" in sd and "layers.1.feed_forward.experts.w1" in sd
    for rank, shard in enumerate(shard_state_dict(sd, mp)):
        meta = to_meta_keys(shard, args)
        assert "layers.0.feed_forward.mlp.fc1_weight" in meta and "layers.0.feed_forward.mlp.layer_norm_weight" in meta
        index = _meta_shard_index(meta, args, mp)
        assert sorted(index) == sorted(shard)
        for name, want in shard.items():
            assert torch.equal(index[name](), want), name


# --- resharding -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "source, world_size",
    [("tiny_ckpt", 2), ("tiny_ckpt_mp2", 1), ("tiny_ckpt_mp4", 2), ("tiny_ckpt_mp2", 2), ("tiny_ckpt_mp4", 1),
     ("tiny_ckpt_hf", 2)],
    ids=["mp1-to-2", "mp2-to-1", "mp4-to-2", "mp2-to-2", "mp4-to-1", "hf-to-2"],
)
def test_resharding_gives_every_rank_its_exact_slice(request, source, world_size, tiny_args, tiny_sd):
    path = request.getfixturevalue(source)
    expected = shard_state_dict(tiny_sd, world_size)
    for rank in range(world_size):
        assert_same_tensors(Checkpoint(path, tiny_args, world_size=world_size, rank=rank), expected[rank])


# --- params.json and config.json ------------------------------------------------------------
ARG_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "norm_eps", "attention_chunk_size",
              "rope_theta", "use_scaled_rope", "rope_scaling_factor", "rope_high_freq_factor", "nope_layer_interval",
              "use_qk_norm", "attn_temperature_tuning", "floor_scale", "attn_scale")


def assert_same_model(a: ModelArgs, b: ModelArgs) -> None:
    for name in ARG_FIELDS:
        assert getattr(a, name) == getattr(b, name), name
    assert a.expert_hidden_dim() == b.expert_hidden_dim()
    assert a.dense_hidden_dim() == b.dense_hidden_dim()
    for name in ("num_experts", "top_k", "interleave_moe_layer_step"):
        assert getattr(a.moe_args, name) == getattr(b.moe_args, name), name
    assert [a.is_moe_layer(i) for i in range(a.n_layers)] == [b.is_moe_layer(i) for i in range(b.n_layers)]
    assert [a.is_nope_layer(i) for i in range(a.n_layers)] == [b.is_nope_layer(i) for i in range(b.n_layers)]


def test_args_from_params_json(tiny_ckpt, tiny_args):
    args = read_model_args(tiny_ckpt, max_seq_len=64, max_batch_size=3)
    assert_same_model(args, tiny_args)
    assert (args.max_seq_len, args.max_batch_size) == (64, 3)
    params = json.loads((tiny_ckpt / "params.json").read_text())
    assert params["moe_args"]["num_experts"] == 4 and "ffn_exp" in params


def test_args_from_config_json_equal_params_json(tiny_ckpt, tiny_ckpt_hf):
    assert_same_model(read_model_args(tiny_ckpt_hf), read_model_args(tiny_ckpt))


def test_meta_params_with_vision_and_runtime_keys_are_accepted(tmp_path, tiny_args):
    vision = VisionArgs(**VISION_ARGS)
    params = {**tiny_args.to_params(), "vision_args": vision.to_params(), "max_seq_len": 99, "max_batch_size": 7}
    (tmp_path / "params.json").write_text(json.dumps(params))
    args = read_model_args(tmp_path, max_seq_len=32, max_batch_size=2)
    assert_same_model(args, tiny_args)
    assert args.vision_args == vision
    assert (args.max_seq_len, args.max_batch_size) == (32, 2)  # the run's limits, not the file's


# --- Meta's hidden-size rules, against llama-models' own modules -------------------------------
SIZING_CASES = [
    # dim, ffn_exp, ffn_dim_multiplier, multiple_of, auto_scale_F, capacity_factor
    (5120, 4.0, 1.2, 2048, True, 1.0),  # Scout / Maverick
    (512, 4.0, 1.2, 2048, True, 1.0),  # Scout-like at reduced dim
    (2048, 3.0, 1.0, 256, False, 1.0),  # the bench preset
    (1008, 2.5, 1.3, 128, True, 1.25),
    (768, 4.0, None, 256, True, 1.0),
]


@pytest.mark.parametrize("dim, ffn_exp, mult, multiple_of, auto_scale, capacity", SIZING_CASES)
def test_hidden_sizes_follow_meta_rules(dist1, monkeypatch, dim, ffn_exp, mult, multiple_of, auto_scale, capacity):
    import llama_models.llama4.model as ref_model
    from llama_models.llama4.args import ModelArgs as RefArgs
    from llama_models.llama4.args import MoEArgs as RefMoEArgs
    from llama_models.llama4.model import TransformerBlock as RefBlock

    # The reference's Attention allocates its KV cache on CUDA; only the feed-forward sizes matter here.
    monkeypatch.setattr(ref_model, "Attention", lambda *args, **kwargs: torch.nn.Identity())

    moe = dict(num_experts=2, top_k=1, interleave_moe_layer_step=2, auto_scale_F=auto_scale, capacity_factor=capacity)
    common = dict(dim=dim, n_layers=2, n_heads=8, n_kv_heads=8, vocab_size=256, ffn_exp=ffn_exp,
                  ffn_dim_multiplier=mult, multiple_of=multiple_of)
    ours = ModelArgs(**common, moe_args=MoEArgs(**moe))
    ref = RefArgs(**common, moe_args=RefMoEArgs(**moe))
    with torch.device("meta"):
        dense = RefBlock(0, ref).feed_forward  # layer 0: dense (MoE every 2nd layer)
        if mult is None:
            # llama-models' MoE multiplies by ffn_dim_multiplier unconditionally, so None means 1.0 there.
            ref = RefArgs(**{**common, "ffn_dim_multiplier": 1.0}, moe_args=RefMoEArgs(**moe))
        routed = RefBlock(1, ref).feed_forward
    assert ours.dense_hidden_dim() == dense.w1.weight.shape[0]
    assert ours.expert_hidden_dim() == routed.experts.w1.shape[2] == routed.shared_expert.w1.weight.shape[0]
    with torch.device("meta"):
        model = Transformer(ModelArgs(**{**common, "n_layers": 2}, moe_args=MoEArgs(**moe)))
    assert model.layers[0].feed_forward.w1.weight.shape == dense.w1.weight.shape
    assert model.layers[1].feed_forward.experts.w1.shape == routed.experts.w1.shape


def test_scout_expert_hidden_size_is_8192():
    scout = ModelArgs(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, vocab_size=202048, ffn_exp=4.0,
                      ffn_dim_multiplier=1.2, multiple_of=2048, moe_args=MoEArgs(num_experts=16))
    assert scout.expert_hidden_dim() == 8192
    assert scout.dense_hidden_dim() == 16384


# --- Hugging Face names ---------------------------------------------------------------------
def test_hf_names_read_back_under_engine_names(tiny_ckpt_hf, tiny_args, tiny_sd):
    assert_same_tensors(Checkpoint(tiny_ckpt_hf, tiny_args), tiny_sd)


@pytest.mark.parametrize(
    "prefix, head",
    [("language_model.model.", "language_model.lm_head.weight"), ("model.language_model.", "lm_head.weight")],
    ids=["language_model.model", "model.language_model"],
)
def test_hf_multimodal_prefixes_are_accepted(tmp_path, tiny_ckpt_hf, tiny_args, tiny_sd, prefix, head):
    """Llama4ForConditionalGeneration: the text model under a prefix, vision weights alongside."""
    tensors = {}
    for name, t in to_hf_keys(tiny_sd).items():
        tensors[head if name == "lm_head.weight" else prefix + name[len("model."):]] = t.contiguous()
    tensors["vision_model.patch_embedding.linear.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    tensors["multi_modal_projector.linear_1.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "model-00001-of-00001.safetensors"))
    config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
              "text_config": hf_config(tiny_args), "vision_config": hf_vision_config(VisionArgs(**VISION_ARGS))}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copyfile(tiny_ckpt_hf / "tokenizer.model", tmp_path / "tokenizer.model")
    args = read_model_args(tmp_path)
    assert_same_model(args, tiny_args)
    assert args.vision_args == VisionArgs(**VISION_ARGS)
    vision = {"vision_embeddings.vision_encoder.conv1._linear.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
              "vision_projection.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}
    assert_same_tensors(Checkpoint(tmp_path, args), {**tiny_sd, **vision})


# --- writing large checkpoints ------------------------------------------------------------------
STREAM_CHECK = """
import json, sys
from pathlib import Path
from llama_lite.synthetic import checkpoint_bytes, preset_args, write_random_checkpoint

def status(key):  # kB figures of /proc/self/status
    return int(next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key)).split()[1])

over = dict(vocab_size=1024, dim=512, n_layers=32)
total = checkpoint_bytes(preset_args("tiny", **over))
# A first small write loads the code the shape pass on meta tensors needs (~160 MB, once per process).
write_random_checkpoint(sys.argv[1] + "-warm", "tiny", mp=2, overrides={**over, "n_layers": 1}, tokenizer_path=sys.argv[2])
Path("/proc/self/clear_refs").write_text("5")  # restart the peak (VmHWM) from the current size
base = status("VmRSS:")
write_random_checkpoint(sys.argv[1], "tiny", mp=2, seed=0, overrides=over, tokenizer_path=sys.argv[2])
print(json.dumps({"grew": (status("VmHWM:") - base) * 1024, "total": total}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures memory through Linux's /proc")
def test_writing_holds_a_few_layers_at_a_time(tmp_path, tiny_ckpt):
    """32 layers of ~13 MB: memory grows by a few layers' worth, not by the checkpoint's 430 MB (the
    bench preset's 9 GB are written with under 4 GB resident, most of it the 202k-token embeddings)."""
    out = subprocess.run([sys.executable, "-c", STREAM_CHECK, str(tmp_path / "big"), str(tiny_ckpt / "tokenizer.model")],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    sizes = json.loads(out.stdout.strip().splitlines()[-1])
    assert sizes["total"] > 400e6
    assert sizes["grew"] < sizes["total"] / 3, sizes


def _file_mappings(directory: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of files under ``directory``."""
    root = str(directory.resolve())
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(root):
            start, end = (int(v, 16) for v in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def _in_file(t: torch.Tensor, ranges) -> bool:
    return any(a <= t.data_ptr() < b for a, b in ranges)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps (Linux)")
def test_the_embedding_table_is_not_a_view_of_the_checkpoint_file(tiny_llama, tiny_ckpt, dist1):
    """Rows of the embedding table are read at random, one per token: a mapped page that is not
    cached costs a disk read per new token, so both loaders copy the table into memory (the
    other bf16 weights, read in order every step, may stay mapped)."""
    import quantization

    ranges = _file_mappings(tiny_ckpt)
    model = tiny_llama.model
    assert ranges and _in_file(model.output.weight, ranges)  # the check can see a mapped weight
    assert not _in_file(model.tok_embeddings.weight, ranges)
    q = quantization.build(tiny_ckpt, "int4_mixed", max_seq_len=64, max_batch_size=1, progress=False)
    assert not _in_file(q.model.tok_embeddings.weight, _file_mappings(tiny_ckpt))


def test_releasing_file_pages_within_a_range_keeps_the_rest(tmp_path):
    """The loader drops the pages of each chunk it has copied; pages outside the range, and memory that
    is not a mapping of the named files (madvise(DONTNEED) would zero anonymous memory), stay."""
    import mmap

    from helpers import resident_bytes
    from llama_lite.checkpoint import release_file_pages

    mib = 1 << 20
    path = tmp_path / "weights.bin"
    path.write_bytes(torch.arange(16 * mib // 4, dtype=torch.int32).numpy().tobytes())
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    t = torch.frombuffer(mapped, dtype=torch.int32)
    lo = t.data_ptr()
    want = int(t.sum())  # faults every page in
    assert resident_bytes(lo, lo + 16 * mib) >= 15 * mib
    released = release_file_pages([path], within=(lo + 4 * mib + 100, lo + 12 * mib))
    assert 8 * mib - 2 * mmap.PAGESIZE <= released <= 8 * mib  # whole pages inside the range only
    assert 7 * mib <= resident_bytes(lo, lo + 16 * mib) <= 9 * mib
    assert int(t.sum()) == want  # file pages map again on access
    anon = torch.arange(4 * mib // 4, dtype=torch.int32)
    assert release_file_pages([path], within=(anon.data_ptr(), anon.data_ptr() + anon.nbytes)) == 0
    assert torch.equal(anon, torch.arange(4 * mib // 4, dtype=torch.int32))
    del t
    mapped.close()
