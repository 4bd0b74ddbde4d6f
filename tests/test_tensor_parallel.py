"""Tensor parallelism under torchrun (2 processes, gloo on CPUs) and loading any MP size at any world size.

fp32 runs compare tightly (the model-parallel partial sums only change summation order). In bf16
each partial sum is rounded before the reduction, so logits differ by bf16 rounding (as between
a 1-row and a 30-row matmul in test_generation) and greedy tokens agree only where the top two
logits are further apart than that.
"""

import importlib.util
import io
import re
from pathlib import Path

import pytest
import torch

from scripts.common import stream_text

HERE = Path(__file__).resolve().parent
BF16_TOL = 0.25

pytestmark = pytest.mark.slow


def load_helper():
    spec = importlib.util.spec_from_file_location("tp_logits", HERE / "tp_logits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def helper():
    return load_helper()


@pytest.fixture(scope="module")
def reference(helper, tiny_ckpt, dist1):
    """The probe in this (single) process: fp32 and bf16, on models built here (fresh caches, as the
    ranks' and the sharded builds have), not the session's shared ones."""
    return {"fp32": helper.probe(helper.build(tiny_ckpt, "fp32")), "bf16": helper.probe(helper.build(tiny_ckpt, "bf16"))}


@pytest.fixture(scope="module")
def world2(helper, run_torchrun, tiny_ckpt, tiny_ckpt_mp2, tiny_ckpt_mp4, tiny_ckpt_hf, tmp_path_factory):
    """One torchrun launch probing every checkpoint layout at world size 2."""
    out = tmp_path_factory.mktemp("tp")
    cases = {"mp1_fp32": (tiny_ckpt, "fp32"), "mp1_bf16": (tiny_ckpt, "bf16"), "mp2_fp32": (tiny_ckpt_mp2, "fp32"),
             "mp4_fp32": (tiny_ckpt_mp4, "fp32"), "hf_fp32": (tiny_ckpt_hf, "fp32")}
    result = run_torchrun(2, HERE / "tp_logits.py", out, *(f"{k}={p}:{d}" for k, (p, d) in cases.items()))
    assert result.returncode == 0, result.stderr[-4000:]
    return {name: torch.load(out / f"{name}.pt", weights_only=True) for name in cases}


def assert_close_fp32(got: dict, want: dict) -> None:
    for key in ("prefill", "decode"):
        diff = (got[key] - want[key]).abs().max().item()
        assert diff < 1e-4, f"{key} logits differ by {diff}"
    assert got["greedy"] == want["greedy"]


@pytest.mark.parametrize("case", ["mp1_fp32", "mp2_fp32", "mp4_fp32", "hf_fp32"])
def test_world_size_2_equals_one_process(world2, reference, case):
    """MP 1 -> 2 (split), MP 2 -> 2 (as stored), MP 4 -> 2 (merged pairs), HF -> 2: the same logits."""
    assert world2[case]["world_size"] == 2
    assert_close_fp32(world2[case], reference["fp32"])


def test_world_size_2_in_bf16_is_within_rounding(world2, reference):
    got, want = world2["mp1_bf16"], reference["bf16"]
    compared = 0
    for key in ("prefill", "decode"):
        diff = (got[key] - want[key]).abs()
        assert diff.max().item() <= BF16_TOL and diff.mean().item() <= 0.02, key
        top2 = want[key].topk(2, dim=-1).values
        clear = (top2[..., 0] - top2[..., 1]) > 2 * BF16_TOL
        compared += int(clear.sum())
        assert torch.equal(got[key].argmax(-1)[clear], want[key].argmax(-1)[clear])
    assert compared > 0  # the argmax comparison is not vacuous (a few decode steps alone may all be close)


@pytest.mark.parametrize("source", ["tiny_ckpt_mp2", "tiny_ckpt_mp4"])
def test_sharded_checkpoint_on_one_process_is_exact(request, helper, reference, source, dist1):
    """MP 2 -> 1 and MP 4 -> 1: the shards concatenate to the very same weights, so logits are equal."""
    llama = helper.build(request.getfixturevalue(source), "fp32")
    got = helper.probe(llama)
    assert torch.equal(got["prefill"], reference["fp32"]["prefill"])
    assert torch.equal(got["decode"], reference["fp32"]["decode"])
    assert got["greedy"] == reference["fp32"]["greedy"]


def test_completion_script_under_torchrun_prints_the_one_process_text(run_torchrun, tiny_ckpt, tiny_llama_fp32):
    prompt = "The capital of France is"
    out = io.StringIO()
    tokens, _, _ = stream_text(tiny_llama_fp32, tiny_llama_fp32.completion([prompt], temperature=0, max_gen_len=8),
                               out=out)
    assert len(tokens) >= 4
    got = run_torchrun(2, "-m", "scripts.completion", tiny_ckpt, "--world_size", 2, "--prompt", prompt,
                       "--max_gen_len", 8, "--temperature", 0, "--dtype", "fp32")
    assert got.returncode == 0, got.stderr[-4000:]
    assert "Traceback" not in got.stderr
    # Printed once: rank 1's stdout is silenced.
    assert got.stdout == out.getvalue() + "\n"


def test_interactive_chat_under_torchrun(run_torchrun, tiny_ckpt):
    """Rank 0 reads stdin and broadcasts each line; both ranks generate together and exit together."""
    got = run_torchrun(2, "-m", "scripts.chat_completion", tiny_ckpt, "--world_size", 2, "--interactive",
                       "--max_gen_len", 4, "--temperature", 0, stdin="hi\nwhat next?\nexit\n")
    assert got.returncode == 0, got.stderr[-4000:]
    assert len(re.findall(r"tokens/s\]", got.stdout)) == 2
    assert "Traceback" not in got.stderr


def test_world_size_flag_must_match_the_launch(run_script, tiny_ckpt):
    got = run_script("scripts.completion", tiny_ckpt, "--world_size", 2, "--prompt", "hi", "--max_gen_len", 2)
    assert got.returncode == 2
    assert "torchrun --nproc-per-node 2" in got.stderr and "Traceback" not in got.stderr
