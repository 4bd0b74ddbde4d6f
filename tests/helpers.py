"""Helpers shared by test modules: synthetic checkpoints and multi-rank runs."""

import os
import socket
import subprocess
import sys
from contextlib import contextmanager
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


@contextmanager
def same_routing(follower, leader):
    """Every MoE layer of `follower` routes as the same layer of `leader` did in its last call (so
    call `leader` first, on the same tokens). For comparing two models that should agree within
    rounding: a top-k choice is discontinuous, so a near-tie between two experts' logits can go
    either way within bf16 rounding of the layer's input (seen on AMD EPYC Zen 4: 2.2812 / 2.2812
    in one model, 2.2500 / 2.2656 in the other) and send a token through another expert. Yields a
    list to which each token whose own choice differs appends (its row in the call's flattened
    [B * S] tokens, the leader's top-k margin: the gap below its k-th logit relative to its largest
    logit); a test asserts those margins are small for real tokens (padding's routing is noise)."""
    flips: list[float] = []
    pinned = []
    for layer_f, layer_l in zip(follower.layers, leader.layers):
        moe_f, moe_l = layer_f.feed_forward, layer_l.feed_forward
        if not hasattr(moe_l, "route"):
            continue
        last = {}

        def lead(x, moe=moe_l, last=last):
            last["logits"], last["out"] = (x @ moe.router_DE).float(), type(moe).route(moe, x)
            return last["out"]

        def follow(x, moe=moe_f, last=last):
            own = torch.topk((x @ moe.router_DE).float(), moe.top_k, dim=-1).indices.sort(-1).values
            ref = last["logits"]
            for row in torch.nonzero((own != ref.topk(moe.top_k, dim=-1).indices.sort(-1).values).any(-1)).flatten():
                top = ref[row].topk(moe.top_k + 1).values
                flips.append((int(row), ((top[-2] - top[-1]) / ref[row].abs().max()).item()))
            return last["out"]

        def lead_one(x, moe=moe_l, last=last):  # one token's top-1 route (decode at batch 1)
            last["logits_one"], last["out_one"] = (x @ moe.router_DE).float(), type(moe).route_one(moe, x)
            return last["out_one"]

        def follow_one(x, moe=moe_f, last=last):
            own, ref = (x @ moe.router_DE).float().argmax(-1), last["logits_one"]
            if int(own) != int(ref.argmax(-1)):
                top = ref[0].topk(2).values
                flips.append((0, ((top[0] - top[1]) / ref[0].abs().max()).item()))
            return last["out_one"]

        moe_l.route, moe_f.route = lead, follow
        moe_l.route_one, moe_f.route_one = lead_one, follow_one
        pinned += [moe_l, moe_f]
    try:
        yield flips
    finally:
        for moe in pinned:
            del moe.route, moe.route_one


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


def mapping_flags(t: torch.Tensor) -> list[tuple[int, int, set]]:
    """(start, end, VmFlags) of each mapping of this process that overlaps t's memory."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.nbytes
    found, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if not head[0].endswith(":"):
                a, b = (int(x, 16) for x in head[0].split("-"))
                cur = (a, b) if a < hi and b > lo else None
            elif head[0] == "VmFlags:" and cur:
                found.append((*cur, set(head[1:])))
    return found


def resident_bytes(lo: int, hi: int) -> int:
    """Resident bytes (smaps Rss) of this process's mappings that overlap [lo, hi)."""
    total, cur = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if not head[0].endswith(":"):
                a, b = (int(x, 16) for x in head[0].split("-"))
                cur = a < hi and b > lo
            elif head[0] == "Rss:" and cur:
                total += int(head[1]) * 1024
    return total
