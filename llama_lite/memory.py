"""How much memory a device has for weights and KV cache, and a clear refusal when they do not fit.

Checked before the KV cache is allocated: a cache the machine cannot hold would otherwise end in
the kernel's OOM killer (no message at all) or an allocator traceback.
"""

import os
from typing import Optional

import torch

from .args import ModelArgs
from .errors import ConfigError
from .kv_cache import kv_cache_bytes, largest_fitting_seq_len

GiB = 1 << 30


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def available_bytes(device: torch.device) -> Optional[int]:
    """Free memory of ``device``: the GPU's free memory, or the host's MemAvailable (RAM that can be
    had without swapping: free pages plus reclaimable caches). None when it cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def processes_sharing(device: torch.device) -> int:
    """Ranks of this run on one host share its RAM (each GPU rank has a device of its own)."""
    if device.type != "cpu":
        return 1
    return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)


def check_fits(args: ModelArgs, weight_bytes: Optional[int], available: Optional[int], kv_dtype: torch.dtype, layout: str,
               world_size: int, sharing: int = 1, where: str = "memory") -> int:
    """The KV cache's bytes per rank; raises ConfigError when ``sharing`` ranks' weights plus KV
    caches exceed ``available`` bytes, saying how much is needed and which max_seq_len would fit.
    ``weight_bytes`` None: the weights are not loaded yet, check the KV cache alone."""
    kv = kv_cache_bytes(args, args.max_seq_len, args.max_batch_size, kv_dtype, layout, world_size)
    if available is None:
        return kv
    need = sharing * ((weight_bytes or 0) + kv)
    if need <= available:
        return kv
    cache = (f"a KV cache of max_seq_len {args.max_seq_len} x max_batch_size {args.max_batch_size} "
             f"({format_bytes(sharing * kv)})")
    what = cache if weight_bytes is None else f"weights ({format_bytes(sharing * weight_bytes)}) plus {cache}"
    verb = "needs" if weight_bytes is None else "need"
    head = f"{what} {verb} {format_bytes(need)}, but only {format_bytes(available)} of {where} is available"
    weight_bytes = weight_bytes or 0
    budget = available // sharing - weight_bytes
    fit = largest_fitting_seq_len(args, budget, args.max_batch_size, kv_dtype, layout, world_size) if budget > 0 else 0
    if fit < 1:
        raise ConfigError(f"{head}: the weights alone do not fit")
    fix = f"max_seq_len {fit} would fit"
    if kv_dtype.itemsize > 1:
        fix += " (or try kv_cache_dtype fp8)"
    raise ConfigError(f"{head}; {fix}")


def stored_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage once (memory-mapped ones too: they
    must stay resident to run at speed)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
