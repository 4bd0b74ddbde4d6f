"""Process-group set-up: torchrun's environment when present, else a single local process."""

import contextlib
import datetime
import io
import os
import socket

import fairscale.nn.model_parallel.initialize as fs_init
import torch
import torch.distributed as dist

from .errors import ConfigError


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(world_size: int | None = None, device: str | None = None) -> tuple[int, int]:
    """Initialise torch.distributed and fairscale's model parallel groups; returns (rank, world size).

    NCCL on GPUs, gloo on CPUs. A collective that waits longer than LLAMA_LITE_DIST_TIMEOUT seconds
    (default 300) fails instead of hanging when a peer rank has died.
    """
    env_world = int(os.environ.get("WORLD_SIZE", 1))
    if world_size is None:
        world_size = env_world
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    if world_size != env_world:
        raise ConfigError(
            f"world_size {world_size} does not match the {env_world} process(es) launched; "
            f"use torchrun --nproc-per-node {world_size}"
        )
    if not dist.is_initialized():
        use_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        backend = "nccl" if use_cuda else "gloo"
        timeout = datetime.timedelta(seconds=float(os.environ.get("LLAMA_LITE_DIST_TIMEOUT", 300)))
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, timeout=timeout
            )
    if not fs_init.model_parallel_is_initialized():
        with contextlib.redirect_stdout(io.StringIO()):  # fairscale prints its group sizes
            fs_init.initialize_model_parallel(world_size)
    elif fs_init.get_model_parallel_world_size() != world_size:
        raise ConfigError(
            f"model parallel is already initialised with size {fs_init.get_model_parallel_world_size()}, not {world_size}"
        )
    return fs_init.get_model_parallel_rank(), world_size
