"""kernels.memory: large CPU tensors copied into memory advised for 2 MiB pages, values unchanged."""

import mmap

import pytest
import torch

from helpers import mapping_flags
import kernels.memory
from kernels.memory import HUGE_PAGE, huge_page_copy, huge_page_empty, thp_enabled


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not thp_enabled(),
                    reason="madvise(MADV_HUGEPAGE) is Linux's, with transparent huge pages not 'never'")
def test_large_tensors_move_to_advised_2mib_aligned_memory():
    t = torch.randn(3 * HUGE_PAGE // 4 + 1000).to(torch.bfloat16).view(-1, 8)  # 3 MiB and a bit
    h = huge_page_copy(t)
    assert torch.equal(h, t) and h.dtype == t.dtype and h.shape == t.shape and h.is_contiguous()
    assert h.data_ptr() != t.data_ptr() and h.data_ptr() % HUGE_PAGE == 0
    maps = mapping_flags(h)
    # the whole 2 MiB pages are advised ("hg") and private; the tail (< 2 MiB) is not
    advised = [(a, b) for a, b, flags in maps if "hg" in flags]
    assert advised == [(h.data_ptr(), h.data_ptr() + HUGE_PAGE)], maps
    assert all("sh" not in flags for _, _, flags in maps)
    h2 = h.clone()
    del t
    h.add_(1)  # the memory stays valid and writable on its own
    assert torch.equal(h, h2 + 1)


def test_small_or_non_cpu_tensors_are_returned_as_they_are():
    small = torch.zeros(HUGE_PAGE // 4 - 1)
    assert huge_page_copy(small) is small
    meta = torch.empty(HUGE_PAGE, device="meta")
    assert huge_page_copy(meta) is meta


def test_without_transparent_huge_pages_nothing_is_copied(monkeypatch):
    """Where the kernel gives no huge pages (THP 'never'), a copy would only cost memory."""
    monkeypatch.setattr(kernels.memory, "thp_enabled", lambda: False)
    t = torch.randn(HUGE_PAGE)  # 8 MiB
    assert huge_page_copy(t) is t
    assert huge_page_empty((HUGE_PAGE,), torch.float32) is None
