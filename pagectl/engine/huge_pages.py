"""CPU memory for the weights a step streams, on 2 MiB pages.

A single-stream decode step reads every weight once, hundreds of megabytes in a few
milliseconds. On 4 KiB pages that read crosses a page every 4 KiB: a TLB miss, and a
boundary the hardware prefetcher does not cross, so every page's stream starts cold.
Transparent huge pages (2 MiB) take both away. Linux backs an anonymous mapping with them when asked
(``madvise(MADV_HUGEPAGE)``; the default ``enabled`` setting, ``madvise``, gives them to
nobody else) and only where a 2 MiB range is aligned and untouched at the first write, so
the memory here is a fresh anonymous mapping, advised before anything writes it, and the
tensor starts at a 2 MiB boundary inside it. Measured on the project's AVX-512 machine: one
pass over the 33.6M model's bfloat16 matmul weights (67 MB, one row) took 1.49-1.99 ms on
huge pages against 1.76-2.21 ms on 4 KiB pages, 1.01-1.27x in 12 alternated pairs
(docs/PERFORMANCE.md, section 12).

Only memory written once, at load, is advised: the first write to a huge page may wait for
the kernel to compact memory into a free 2 MiB page (``defrag`` ``madvise``, the default), so
writing a fresh 268 MB mapping one element per 4 KiB took 20-381 ms on huge pages against
71-81 ms on 4 KiB pages in the same minutes. The KV pool, committed block by block as
requests first write it (inside steps), stays on 4 KiB pages (``huge=False``).

Where the OS has no such pages (another OS, THP ``never``, none free) the mapping is plain
anonymous memory: the same zero-filled, lazily committed pages as before. ``empty`` gives
tensors below one huge page, and any tensor off the CPU, as ordinary ``torch.empty`` ones.
``PAGECTL_HUGE_PAGES=0`` turns the advice off (plain mappings).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os

import torch

HUGE_PAGE_BYTES = 2 << 20


def _mapping(nbytes: int) -> mmap.mmap:
    """A fresh anonymous mapping, private where the OS has the flag (Windows has none).
    Python's default for an anonymous mapping is MAP_SHARED, which Linux serves from shmem
    (no huge pages under the default ``shmem_enabled`` of ``never``, and pages a forked child
    would share)."""
    if hasattr(mmap, "MAP_PRIVATE"):
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mmap.mmap(-1, nbytes)


def advice_enabled() -> bool:
    """Whether mappings made here ask for huge pages (Linux, not turned off)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("PAGECTL_HUGE_PAGES", "1") != "0"


def mapped_empty(
    shape: tuple[int, ...] | list[int], dtype: torch.dtype, *, huge: bool = True
) -> torch.Tensor:
    """A zero-filled, lazily committed CPU tensor on a fresh private anonymous mapping,
    aligned to and advised for huge pages unless ``huge`` is False (module docstring). The
    tensor keeps the mapping alive; it is unmapped when the last view of it goes."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if nbytes < HUGE_PAGE_BYTES or not huge:
        m = _mapping(nbytes)
        return torch.frombuffer(m, dtype=dtype, count=numel).view(shape)
    # One huge page more than needed, so that a 2 MiB boundary lies within its first one.
    m = _mapping(nbytes + HUGE_PAGE_BYTES)
    if advice_enabled():
        with contextlib.suppress(OSError):  # a kernel built without THP: plain pages
            m.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr()
    offset = -base % HUGE_PAGE_BYTES
    return torch.frombuffer(m, dtype=dtype, count=numel, offset=offset).view(shape)


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the default device (``dtype`` None: the default
    dtype), on huge pages where that device is the CPU and the tensor spans at least one
    (``mapped_empty``)."""
    dtype = dtype or torch.get_default_dtype()
    if torch.get_default_device().type != "cpu":
        return torch.empty(shape, dtype=dtype)
    if math.prod(shape) * dtype.itemsize < HUGE_PAGE_BYTES:
        return torch.empty(shape, dtype=dtype)
    return mapped_empty(shape, dtype)


def rehome(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a contiguous tensor on huge pages (a copy), or ``t`` itself when it
    is off the CPU, smaller than a huge page, or not a plain strided tensor (oneDNN's
    opaque layout)."""
    if (
        t.device.type != "cpu"
        or t.layout != torch.strided
        or t.numel() * t.element_size() < HUGE_PAGE_BYTES
    ):
        return t
    out = mapped_empty(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out
