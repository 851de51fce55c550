"""Weights and the KV pool on mappings advised for transparent huge pages (huge_pages.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from pagectl.engine import huge_pages
from pagectl.engine.runner.kv_cache import KVCachePool

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``addr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_a_large_tensor_is_aligned_zeroed_and_usable():
    t = huge_pages.mapped_empty((3, 1024, 1024), torch.bfloat16)
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert not t.any()
    t[1].fill_(2)
    assert t.float().sum().item() == 2 * 1024 * 1024
    small = huge_pages.mapped_empty((5, 7), torch.float32)
    assert small.shape == (5, 7) and not small.any()
    assert huge_pages.mapped_empty((0, 4), torch.float32).shape == (0, 4)


def test_rehome_copies_values_and_leaves_small_or_foreign_tensors():
    src = torch.randn(1024, 1024)  # 4 MiB
    moved = huge_pages.rehome(src)
    assert moved.data_ptr() != src.data_ptr() and torch.equal(moved, src)
    assert moved.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    small = torch.randn(16, 16)
    assert huge_pages.rehome(small) is small


@linux
def test_the_mapping_is_advised_unless_turned_off(monkeypatch):
    t = huge_pages.mapped_empty((1024, 1024), torch.float32)
    flags = vm_flags(t.data_ptr())
    if "hg" not in flags:
        pytest.skip("this kernel takes no MADV_HUGEPAGE (built without THP)")
    monkeypatch.setenv("PAGECTL_HUGE_PAGES", "0")
    plain = huge_pages.mapped_empty((1024, 1024), torch.float32)
    assert "hg" not in vm_flags(plain.data_ptr())


@linux
def test_the_kv_pool_is_private_and_not_advised():
    pool = KVCachePool(2, 64, 16, 4, 64, torch.float32, torch.device("cpu"))
    flags = vm_flags(pool.tensor.data_ptr())
    # Private (no "sh"): a forked child would not share it. Not advised: its pages are
    # first written inside steps, where a huge page's fault may wait for compaction.
    assert "sh" not in flags and "hg" not in flags
    assert not pool.tensor.any()
    pool.release()


def test_layer_weights_are_made_on_huge_page_mappings():
    from pagectl.engine.models.linear import ColumnParallelLinear

    layer = ColumnParallelLinear(1024, 2048, params_dtype=torch.bfloat16)  # 4 MiB
    assert layer.weight.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    tiny = ColumnParallelLinear(64, 64, params_dtype=torch.float32)
    assert tiny.weight.shape == (64, 64)
