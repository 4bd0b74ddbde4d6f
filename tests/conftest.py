import os
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from helpers import make_checkpoint  # noqa: E402,F401  (re-exported for test modules)

# torchvision from the package registry is a CUDA build whose C extension does not load with the CPU
# torch; its import then fails registering meta kernels for the missing ops. The reference image
# transforms (llama-models', transformers') are pure Python, so the registrations are made an empty
# module before anything imports torchvision.
sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))

torch.set_num_threads(min(2, os.cpu_count() or 1))

# Models build eager in the suite (and in the scripts it runs), whatever the environment says:
# compiling a decode step takes tens of seconds on two cores. tests/test_compile.py builds
# compiled models on purpose.
os.environ["LLAMA_LITE_COMPILE"] = "0"


@pytest.fixture(scope="session")
def dist1():
    """A single-process group (gloo) with model parallel size 1."""
    from llama_lite.distributed import init_distributed

    init_distributed(1, "cpu")


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def tiny_ckpt(ckpt_root) -> Path:
    """The tiny preset, Meta layout, one shard."""
    return make_checkpoint(ckpt_root, "tiny", preset="tiny", mp=1, seed=0)


@pytest.fixture(scope="session")
def tiny_llama(tiny_ckpt, dist1):
    from llama_lite.generation import Llama4

    return Llama4.build(tiny_ckpt, max_seq_len=128, max_batch_size=4)


@pytest.fixture(scope="session")
def tiny_llama_fp32(tiny_ckpt, dist1):
    """The same weights run in fp32: logic checks with tight tolerances, free of bf16 rounding."""
    from llama_lite.generation import Llama4

    return Llama4.build(tiny_ckpt, max_seq_len=128, max_batch_size=4, dtype=torch.float32)


# --- the tiny weights (seed 0) in other layouts: resharding, tensor parallel, bad-input tests ---
@pytest.fixture(scope="session")
def tiny_ckpt_mp2(ckpt_root) -> Path:
    """The tiny preset's weights (same seed as tiny_ckpt), Meta layout, two model-parallel shards."""
    return make_checkpoint(ckpt_root, "tiny-mp2", preset="tiny", mp=2, seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_mp4(ckpt_root) -> Path:
    """The tiny preset's weights, four shards (more shards than KV heads: each holds half a head)."""
    return make_checkpoint(ckpt_root, "tiny-mp4", preset="tiny", mp=4, seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_hf(ckpt_root) -> Path:
    """The tiny preset's weights in Hugging Face's layout (config.json + model.safetensors)."""
    return make_checkpoint(ckpt_root, "tiny-hf", preset="tiny", mp=1, seed=0, fmt="hf")


# --- running the scripts as a user does: a subprocess, alone or under torchrun ---
def _free_tcp_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list, stdin, timeout: float, env=None):
    """subprocess.run that, on timeout, kills the whole process group (torchrun's workers too)."""
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} timed out after {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="session")
def run_script():
    """run_script("scripts.completion", CKPT, "--prompt", "hi", stdin=None, timeout=240) -> CompletedProcess."""

    def run(module: str, *args, stdin=None, timeout: float = 240, env=None):
        return _run([sys.executable, "-m", module, *map(str, args)], stdin, timeout, env)

    return run


@pytest.fixture(scope="session")
def run_torchrun():
    """run_torchrun(2, "-m", "scripts.completion", CKPT, ...) under torchrun (gloo on CPUs) on a free port."""

    def run(nproc: int, *args, stdin=None, timeout: float = 300, env=None):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_tcp_port()), *map(str, args)]
        # A dead peer makes a collective fail after this many seconds instead of hanging the test.
        return _run(cmd, stdin, timeout, {"LLAMA_LITE_DIST_TIMEOUT": "120", **(env or {})})

    return run
