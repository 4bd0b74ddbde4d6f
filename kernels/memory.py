"""Where weights live in CPU memory: 2 MiB pages for the large ones.

Decode reads every weight once per token, a few GB in 4 KiB pages: a TLB miss every 4 KiB, and
the page walks' loads compete with the weights' own. Linux gives an anonymous mapping huge
(2 MiB) pages where the mapping asks for them (``madvise(MADV_HUGEPAGE)``; the system default,
``/sys/kernel/mm/transparent_hugepage/enabled``, is often ``madvise``), and PyTorch's allocator does
not ask. ``huge_page_copy`` puts a tensor into such a mapping, 2 MiB aligned.

Measured on 2 AMD EPYC Zen 4 cores (README "CPU paths"), with PyTorch's allocator in 4 KiB pages
against 2 MiB ones: a plain streaming read 29.9 -> 58.8 GB/s, an int4 4096 x 2048 GEMV streaming
from memory 11.6 -> 20.6 GB/s; an int4_all decode step of the bench preset, this copy against
none, three alternating pairs of processes: 42.4-44.9 -> 34.4-40.4 ms.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 * 1024 * 1024
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor in memory advised for huge pages, or ``t`` itself where that
    does not apply (not on the CPU, under 2 MiB, or no ``MADV_HUGEPAGE`` on this system).

    The copy has ``t``'s values, dtype and shape; its memory (an anonymous mapping, freed with the
    tensor) is faulted in as the values are copied, so it takes huge pages from the start rather
    than waiting for the kernel's background collapsing.
    """
    if _ADVICE is None or t.device.type != "cpu" or t.nbytes < HUGE_PAGE or t.is_quantized or t.is_sparse:
        return t
    buf = mmap.mmap(-1, t.nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # private: shared memory has its own THP switch
    # the mapping's start is page aligned; the tensor starts at its first 2 MiB boundary, and only
    # its whole 2 MiB pages are advised (a huge page for the tail would hold up to 2 MiB unused)
    start = torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE_PAGE
    try:
        buf.madvise(_ADVICE, offset, t.nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel without transparent huge pages
        buf.close()
        return t
    out = torch.frombuffer(buf, dtype=torch.uint8, count=t.nbytes, offset=offset).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
