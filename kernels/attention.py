"""Attention of one new token per row over its KV cache (a decode step): the AVX2 library's kernel
on x86 CPUs (every cap but ``none``; AVX-512 CPUs run it too), PyTorch's SDPA elsewhere. And of
many new tokens per row (a prefill) under the avx512 cap: the AVX-512 library's kernel.

    decode_attention(q, keys, values, mask) -> [B, 1, H, D]
    decode_step(q, k, v, cache_k, cache_v, k_scale, v_scale, positions, chunk, ring) -> [B, 1, H, D] or None
    prefill_attention(q, keys, values, mask) -> [B, S, H, D] or None

q [B, 1, H, D]; keys / values [B, n, Hkv, D], views of a cache with any strides (D contiguous);
mask [B, 1, 1, n] bool, True where a row may attend. Query head h reads KV head h // (H / Hkv),
scale 1 / sqrt(D). Numerics: ``kernels.reference.decode_attention`` (fp32 scores, softmax and
weighted sum, one rounding to q's dtype) up to fp32 summation order and a few ulp of e^x. Where
the kernel does not apply (other devices or dtypes, D not a multiple of 8, no library) it is SDPA,
as the core computes it.

``decode_step`` is the whole of a decode step's attention in one library call: the new keys and
values written into a bf16 cache and the attention over each row's slots, its mask made from the
positions in C (the core's ``decode_attention`` step with PyTorch ops: ~15 small operators and a
[B, 1, 1, n] mask per layer, ~2.6 ms of a ~80 ms int4 decode step on an AMX Xeon).

Why a kernel: PyTorch's CPU SDPA on bf16 takes 10-25x as long as reading the cache on a CPU
without AVX-512 BF16 (an AMD EPYC: 0.2 ms per layer at 40 cached tokens, 44 ms at 8192), which
at a long context outweighs every weight the step reads.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import torch
import torch.nn.functional as F

from .cpu_lib import isa, library

log = logging.getLogger("llama_lite.kernels")
_logged: set[str] = set()


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def _kernel_applies(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    if q.device.type != "cpu" or q.shape[1] != 1 or isa() == "none":
        return False
    if not (q.dtype == keys.dtype == values.dtype == torch.bfloat16):
        return False
    h, d, hkv = q.shape[2], q.shape[3], keys.shape[2]
    return d % 8 == 0 and h % hkv == 0 and keys.stride(-1) == 1 and values.stride(-1) == 1


def path(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> str:
    """The implementation ``decode_attention`` takes for these tensors: ``cpu/<cap>`` or ``sdpa``."""
    return f"cpu/{isa()}" if _kernel_applies(q, keys, values) else "sdpa"


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """See the module docstring. ``out_dtype`` torch.float32 returns the kernel's fp32 result before
    its rounding (tests); default q's dtype."""
    where = path(q, keys, values)
    if where not in _logged:
        _logged.add(where)
        log.info("kernels: decode attention -> %s", where if where == "sdpa" else f"{where}: fp32 single-query kernel")
    if where == "sdpa":
        out = _sdpa(q, keys, values, mask)
        return out if out_dtype is None else out.to(out_dtype)
    b, _, h, d = q.shape
    n, hkv = keys.shape[1], keys.shape[2]
    q = q.contiguous()
    m = mask.reshape(b, n).contiguous()
    strides = (ctypes.c_int64 * 6)(keys.stride(0), keys.stride(1), keys.stride(2),
                                   values.stride(0), values.stride(1), values.stride(2))  # fmt: skip
    fp32 = out_dtype == torch.float32
    out = torch.empty(b, 1, h, d, dtype=torch.float32 if fp32 else torch.bfloat16)
    rc = library("avx2").llk_decode_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), strides, m.data_ptr(),
                                              b, h, hkv, d, n, d**-0.5, out.data_ptr(), 0 if fp32 else 1,
                                              torch.get_num_threads())  # fmt: skip
    if rc:
        raise RuntimeError("llk_decode_attention rejected shapes that decode_attention accepted")  # a bug
    return out


def decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                k_scale: torch.Tensor, v_scale: torch.Tensor, positions: torch.Tensor, chunk: int,
                ring: bool) -> Optional[torch.Tensor]:
    """One decode step of one attention layer, as the core's ``kv_cache.decode_attention_eager``
    computes it on a CPU with this module's kernel as its attention (same cache contents, same
    bits), in one library call; None where the kernel does not apply (then the core does the step).

    q [B, 1, H, D], k / v [B, 1, Hkv, D] at ``positions`` [B]; row b's key and value go to slot
    p % chunk of a ring cache, else slot p, and it attends over the slots of its chunk up to its own
    (a ring's [0, p % chunk], a prefix cache's [p - p % chunk, p] with ``chunk`` > 0, else [0, p]).
    ``k_scale`` / ``v_scale``: the cache's fp8 scales (empty for a bf16 cache; fp8 caches never apply).
    """
    if q.shape[1] != 1 or k.shape[1] != 1 or not _kernel_applies(q, cache_k, cache_v):
        return None
    if k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    b, _, h, d = q.shape
    hkv = cache_k.shape[2]
    if k.shape[2:] != (hkv, d) or v.shape[2:] != (hkv, d) or k.shape[0] != b or positions.device.type != "cpu":
        return None
    where = f"step:{path(q, cache_k, cache_v)}"
    if where not in _logged:
        _logged.add(where)
        log.info("kernels: decode step -> %s: cache write and fp32 single-query kernel in one call", where[5:])
    pos = positions.tolist()
    slot = [p % chunk for p in pos] if ring else pos
    lo = [p - p % chunk for p in pos] if chunk and not ring else [0] * b
    q = q.contiguous()
    i64 = ctypes.c_int64
    new_strides = (i64 * 4)(k.stride(0), k.stride(2), v.stride(0), v.stride(2))
    strides = (i64 * 6)(*cache_k.stride()[:3], *cache_v.stride()[:3])
    out = torch.empty(b, 1, h, d, dtype=torch.bfloat16)
    rc = library("avx2").llk_decode_step(q.data_ptr(), k.data_ptr(), v.data_ptr(), new_strides, cache_k.data_ptr(),
                                         cache_v.data_ptr(), strides, cache_k.shape[1], (i64 * b)(*slot),
                                         (i64 * b)(*lo), b, h, hkv, d, d**-0.5, out.data_ptr(), 1,
                                         torch.get_num_threads())  # fmt: skip
    if rc:
        raise RuntimeError(f"llk_decode_step rejected positions {pos} for a cache of {cache_k.shape[1]} slots")
    return out


def _prefill_applies(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> bool:
    if q.device.type != "cpu" or isa() != "avx512" or mask.dtype != torch.bool:
        return False
    if not (q.dtype == keys.dtype == values.dtype == torch.bfloat16):
        return False
    (b, s, h, d), (n, hkv) = q.shape, keys.shape[1:3]
    return (d % 16 == 0 and d <= 512 and h % hkv == 0 and values.shape == keys.shape and keys.shape[0] == b
            and mask.shape == (b, 1, s, n) and q.stride(-1) == keys.stride(-1) == values.stride(-1) == 1)


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      out_dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    """Attention of S queries per row over n keys: q [B, S, H, D], keys / values [B, n, Hkv, D]
    (views of a cache, D contiguous), mask [B, 1, S, n] bool (True = may attend); [B, S, H, D] in
    q's dtype (``out_dtype`` torch.float32: the fp32 result before its rounding), or None where
    the kernel does not apply (the caller runs SDPA). Numerics: ``kernels.reference.decode_attention``
    (which takes any number of queries) up to fp32 summation order and a few ulp of e^x; a query
    with nothing to attend to gives zeros.

    Only under the avx512 cap (AVX512-BF16 without AMX: AMD EPYC Zen 4/5), where it was measured:
    on a Zen 5 PyTorch's CPU flash attention took ~13 ms per layer of 16 heads at 512 tokens
    (~80 GFLOP/s of the causal half); this kernel computes only each query's span of allowed
    keys, scores with vdpbf16ps and the weighted sum with fp32 FMAs. AMX Xeons keep SDPA until
    measured there."""
    if not _prefill_applies(q, keys, values, mask):
        return None
    where = f"cpu/{isa()}"
    if f"prefill:{where}" not in _logged:
        _logged.add(f"prefill:{where}")
        log.info("kernels: prefill attention -> %s: bf16-dot scores, fp32 softmax and weighted sum", where)
    b, s, h, d = q.shape
    n, hkv = keys.shape[1], keys.shape[2]
    m = mask.reshape(b, s, n).contiguous()
    i64 = ctypes.c_int64
    qs = (i64 * 3)(q.stride(0), q.stride(1), q.stride(2))
    kvs = (i64 * 6)(*keys.stride()[:3], *values.stride()[:3])
    fp32 = out_dtype == torch.float32
    out = torch.empty(b, s, h, d, dtype=torch.float32 if fp32 else torch.bfloat16)
    rc = library("avx512").llk_prefill_attention(q.data_ptr(), qs, keys.data_ptr(), values.data_ptr(), kvs,
                                                 m.data_ptr(), b, s, h, hkv, d, n, d**-0.5, out.data_ptr(),
                                                 0 if fp32 else 1, torch.get_num_threads())  # fmt: skip
    if rc:
        raise RuntimeError("llk_prefill_attention rejected shapes that prefill_attention accepted")  # a bug
    return out
