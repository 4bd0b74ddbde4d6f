"""Helpers shared by test modules: synthetic checkpoints and multi-rank runs."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "quant_worker.py"


def make_checkpoint(root: Path, name: str, **kwargs) -> Path:
    """A synthetic checkpoint under root/name, written once per session."""
    from llama_lite.synthetic import write_random_checkpoint

    path = root / name
    if not path.exists():
        write_random_checkpoint(path, **kwargs)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(nproc: int, args: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a script (or ``-m module``) under torchrun with ``nproc`` gloo ranks, or plainly for 1."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def worker_results(tmp: Path, ckpt: Path, modes: str, world: int, targets: str = "", isa: str = "") -> dict:
    """Greedy tokens and logits per mode from tests/workers/quant_worker.py at ``world`` ranks
    (under the CPU cap ``isa``, LLAMA_LITE_CPU_ISA, when given)."""
    out = tmp / f"w{world}-{modes.replace(',', '_')}-{ckpt.name}{'-' + isa if isa else ''}.pt"
    env = {"LLAMA_LITE_CPU_ISA": isa} if isa else None
    proc = run_ranks(world, [str(WORKER), str(ckpt), str(out), modes, str(world), targets], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)
