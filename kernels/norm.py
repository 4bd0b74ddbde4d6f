"""RMSNorm of bf16 rows in one library call (the AVX2 library, which AVX-512 CPUs run too):

    rmsnorm(x, weight, eps) -> bf16 tensor shaped as x, or None where the kernel does not apply

The core's ``RMSNorm`` (``rmsnorm(x, eps) * weight``; ``weight`` None: the bare norm of the
query/key heads) is ~8 small PyTorch operators per call; a decode step calls it ~45 times on the
bench preset, which measured 2-4 ms of a ~45 ms int4 step on a 2-core AMD EPYC. Same fp32 math and
the same two roundings to bf16 as the core; only the order of the sum of squares differs, so a
value that lands on a bf16 rounding tie can come out one ulp apart. None (the caller computes it)
unless x is a bf16 CPU tensor with a contiguous last dimension, the weight (if any) bf16 of that
size, and the CPU cap is not ``none``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .cpu_lib import isa, library


def rmsnorm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> Optional[torch.Tensor]:
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.dim() == 0 or isa() == "none":
        return None
    dim = x.shape[-1]
    if weight is not None and (weight.dtype != torch.bfloat16 or weight.shape != (dim,) or weight.stride(-1) != 1):
        return None
    x2 = x.reshape(-1, dim)
    if x2.stride(-1) != 1:
        return None
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    rc = library("avx2").llk_rmsnorm_bf16(x2.data_ptr(), x2.stride(0), None if weight is None else weight.data_ptr(),
                                          out.data_ptr(), dim, x2.shape[0], dim, eps, torch.get_num_threads())  # fmt: skip
    if rc:
        raise RuntimeError(f"llk_rmsnorm_bf16 rejected a [{x2.shape[0]}, {dim}] input")  # a bug
    return out
