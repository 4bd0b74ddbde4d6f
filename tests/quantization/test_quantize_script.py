"""scripts.quantize: multi-rank quantization, round trips at other world sizes, and safe output."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import ROOT, make_checkpoint, run_ranks, worker_results

MODES = ["int4_mixed", "fp8_mixed", "w4a8", "nvfp4"]


def quantize(src, out, mode, nproc, *extra):
    return run_ranks(nproc, ["-m", "scripts.quantize", "--ckpt_dir", str(src), "--output_dir", str(out),
                             "--quantization_mode", mode, "--world_size", str(nproc), *extra])


@pytest.fixture(scope="module")
def tiny_mp2(ckpt_root):
    return make_checkpoint(ckpt_root, "tiny-mp2", preset="tiny", mp=2, seed=0)


@pytest.mark.slow
def test_round_trip_every_mode(tiny_mp2, tmp_path):
    """Quantized by 2 ranks and loaded by 1 process == the same bf16 checkpoint quantized on the
    fly by 1 process, bit for bit (every weight is quantized whole, then sliced)."""
    for mode in MODES:
        proc = quantize(tiny_mp2, tmp_path / mode, mode, 2)
        assert proc.returncode == 0, proc.stderr[-2000:]
        cfg = json.loads((tmp_path / mode / "quantization.json").read_text())
        assert cfg["quantization_mode"] == mode and cfg["mp"] == 2
        assert sorted(p.name for p in (tmp_path / mode).iterdir()) == [
            "model.00.safetensors", "model.01.safetensors", "params.json", "quantization.json", "tokenizer.model"]
    on_the_fly = worker_results(tmp_path, tiny_mp2, ",".join(MODES), 1)
    for mode in MODES:
        loaded = worker_results(tmp_path, tmp_path / mode, mode, 1)[mode]
        assert torch.equal(loaded["logits"], on_the_fly[mode]["logits"]), mode
        assert loaded["greedy"] == on_the_fly[mode]["greedy"], mode


def test_stored_dtypes_are_real(tiny_mp2, tmp_path):
    from safetensors import safe_open

    assert quantize(tiny_mp2, tmp_path / "w4a8", "w4a8", 1).returncode == 0
    with safe_open(str(tmp_path / "w4a8" / "model.00.safetensors"), "pt") as f:
        name = "layers.1.feed_forward.experts.w1"
        assert f.get_tensor(name + ".qweight").dtype == torch.uint8
        assert f.get_tensor(name + ".group_scales").dtype == torch.float8_e4m3fn
        assert f.get_tensor(name + ".channel_scales").dtype == torch.float32


@pytest.mark.slow
def test_int4_loads_at_other_world_sizes(ckpt_root, tmp_path):
    """MP=4 -> 1 process and MP=1 -> 2 ranks give the same greedy tokens."""
    src = make_checkpoint(ckpt_root, "tiny-mp1-kv4", preset="tiny", mp=1, seed=4,
                          overrides=dict(n_heads=4, n_kv_heads=4, multiple_of=512))  # 4-way K splits keep whole groups
    for nproc in (4, 1):
        assert quantize(src, tmp_path / f"int4-mp{nproc}", "int4_mixed", nproc).returncode == 0
    base = worker_results(tmp_path, src, "int4_mixed", 1)["int4_mixed"]["greedy"]
    assert worker_results(tmp_path, tmp_path / "int4-mp4", "int4_mixed", 1)["int4_mixed"]["greedy"] == base
    assert worker_results(tmp_path, tmp_path / "int4-mp1", "int4_mixed", 2)["int4_mixed"]["greedy"] == base


def test_w4a8_from_an_int4_output(tiny_mp2, tmp_path):
    assert quantize(tiny_mp2, tmp_path / "int4", "int4_mixed", 1).returncode == 0
    proc = quantize(tmp_path / "int4", tmp_path / "w4a8", "w4a8", 1)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "w4a8" / "quantization.json").read_text())["quantization_mode"] == "w4a8"


def test_existing_output_refused_without_force(tiny_mp2, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = quantize(tiny_mp2, out, "int4_mixed", 1)
    assert proc.returncode == 2 and "already exists" in proc.stderr and "Traceback" not in proc.stderr
    assert quantize(tiny_mp2, out, "int4_mixed", 1, "--force").returncode == 0
    assert (out / "quantization.json").is_file()


def test_wrong_mode_for_a_quantized_checkpoint(tiny_mp2, tmp_path):
    assert quantize(tiny_mp2, tmp_path / "fp8", "fp8_mixed", 1).returncode == 0
    proc = run_ranks(1, ["-m", "scripts.completion", str(tmp_path / "fp8"), "--prompt", "hi",
                         "--quantization_mode", "int4_mixed", "--max_gen_len", "2"])
    assert proc.returncode != 0 and "fp8_mixed" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_scales_are_reported(tiny_mp2, tmp_path, dist1):
    from safetensors.torch import load_file, save_file

    from llama_lite.errors import CheckpointError
    from quantization import build

    out = tmp_path / "int4"
    assert quantize(tiny_mp2, out, "int4_mixed", 1).returncode == 0
    f = out / "model.00.safetensors"
    tensors = load_file(str(f))
    del tensors["layers.2.feed_forward.experts.w2.scales"]
    save_file(tensors, str(f))
    with pytest.raises(CheckpointError, match="lacks scales"):
        build(out, "int4_mixed", max_seq_len=32, max_batch_size=1, progress=False)


@pytest.mark.slow
def test_killed_run_leaves_no_output_and_rerun_works(ckpt_root, tmp_path):
    src = make_checkpoint(ckpt_root, "small-mp2", preset="small", mp=2, seed=0)
    out = tmp_path / "q"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for delay in (1.0, 3.0, 6.0):
        proc = subprocess.Popen(
            [sys.executable, "-m", "scripts.quantize", "--ckpt_dir", str(src), "--output_dir", str(out),
             "--quantization_mode", "int4_mixed"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        # Either nothing, or a complete folder that loads.
        assert not out.exists() or (out / "quantization.json").is_file()
        if out.exists():
            break
    if out.exists():
        import shutil

        shutil.rmtree(out)
    assert quantize(src, out, "int4_mixed", 1).returncode == 0
    assert (out / "quantization.json").is_file()
