import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from helpers import make_checkpoint  # noqa: E402,F401  (re-exported for test modules)

torch.set_num_threads(min(2, os.cpu_count() or 1))


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
