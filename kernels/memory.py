"""Where weights live in CPU memory: 2 MiB pages for the large ones.

Decode reads every weight once per token, a few GB in 4 KiB pages: a TLB miss every 4 KiB, and
the page walks' loads compete with the weights' own. Linux gives an anonymous mapping huge
(2 MiB) pages where the mapping asks for them (``madvise(MADV_HUGEPAGE)``; the system default,
``/sys/kernel/mm/transparent_hugepage/enabled``, is often ``madvise``), and PyTorch's allocator does
not ask. ``huge_page_copy`` puts a tensor into such a mapping, 2 MiB aligned (``huge_page_empty``
gives one to fill). The quantized loader places there every weight of 2 MiB or more that runs on
the CPU, bf16 ones copied out of the memory-mapped checkpoint included (its page cache lies in
4 KiB pages too).

Measured on 2 AMD EPYC Zen 4 cores (README "CPU paths"), with PyTorch's allocator in 4 KiB pages
against 2 MiB ones: a plain streaming read 29.9 -> 58.8 GB/s, an int4 4096 x 2048 GEMV streaming
from memory 11.6 -> 20.6 GB/s; an int4_all decode step of the bench preset, this copy against
none, three alternating pairs of processes: 42.4-44.9 -> 34.4-40.4 ms.
"""

from __future__ import annotations

import functools
import math
import mmap
from typing import Callable, Optional

import torch

HUGE_PAGE = 2 * 1024 * 1024
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


@functools.lru_cache(maxsize=None)
def thp_enabled() -> bool:
    """Whether this kernel gives advised mappings huge pages (transparent huge pages ``always`` or
    ``madvise``). Where it does not, a copy would only cost memory: the loader keeps its views."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """An uninitialised contiguous CPU tensor in memory advised for huge pages, or None where that
    does not apply (under 2 MiB, no ``MADV_HUGEPAGE``, or transparent huge pages off: ``thp_enabled``).

    Its memory is an anonymous mapping, freed with the tensor; pages are faulted in when first
    written, so a tensor filled right away takes huge pages from the start rather than waiting for
    the kernel's background collapsing.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if _ADVICE is None or nbytes < HUGE_PAGE or not thp_enabled():
        return None
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # private: shared memory has its own THP switch
    # the mapping's start is page aligned; the tensor starts at its first 2 MiB boundary, and only
    # its whole 2 MiB pages are advised (a huge page for the tail would hold up to 2 MiB unused)
    start = torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE_PAGE
    try:
        buf.madvise(_ADVICE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel without transparent huge pages
        buf.close()
        return None
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)


COPY_CHUNK = 64 << 20  # bytes huge_page_copy copies between two calls of its ``copied``


def huge_page_copy(t: torch.Tensor, copied: Optional[Callable[[int, int], None]] = None) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor in memory advised for huge pages (``huge_page_empty``), or
    ``t`` itself where that does not apply (not on the CPU, or as ``huge_page_empty`` says).

    ``copied(start, end)``: called with the source addresses of each ``COPY_CHUNK`` of a contiguous
    ``t`` once that chunk is copied (the loader drops those pages of the memory-mapped checkpoint,
    so a large tensor's file pages and its copy are never both held whole)."""
    if t.device.type != "cpu" or t.is_quantized or t.is_sparse:
        return t
    out = huge_page_empty(tuple(t.shape), t.dtype)
    if out is None:
        return t
    if copied is None or not t.is_contiguous():
        out.copy_(t)
        return out
    src, dst = t.reshape(-1), out.view(-1)
    step = max(1, COPY_CHUNK // t.element_size())
    for i in range(0, src.numel(), step):
        part = src[i : i + step]
        dst[i : i + step].copy_(part)
        copied(part.data_ptr(), part.data_ptr() + part.nbytes)
    return out
