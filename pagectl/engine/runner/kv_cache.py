"""The KV pool's tensors and how big they may be.

Layout: one tensor ``[num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim]``
allocated once at start, zero-filled: masked padding still flows through attention matmuls,
so every slot must hold a finite value. On CPU the memory is an anonymous mapping, which the
OS hands out zero-filled and commits page by page on first write: a large pool costs nothing until it is used. Index 0 of dim 1 holds keys, 1 values; per layer the
``[num_blocks + 1, block_size, kv_heads, head_dim]`` halves are exactly flash-attn's paged
layout. Block ids ``[0, num_blocks)`` are the scheduler's; block ``num_blocks`` is the scratch
block: padding rows write there and padded block-table entries point there. No sequence ever
owns it.

Sizing (bytes per block = 2 x layers x block_size x kv_heads_per_rank x head_dim x dtype size):
an explicit ``num_kv_blocks``; else ``kv_cache_memory`` bytes; else on CUDA the
``gpu_memory_utilization`` share left after weights and a warm-up forward's peak; else on CPU
2 GiB, capped at a quarter of system RAM.
"""

from __future__ import annotations

import os

import torch

from pagectl.engine import huge_pages

CPU_DEFAULT_BYTES = 2 << 30
CPU_MAX_RAM_FRACTION = 0.25


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """KV bytes one block takes on one rank, over all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def system_memory_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # psutil missing or restricted: fall back to sysconf
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_cpu_kv_bytes() -> int:
    """2 GiB, but never more than a quarter of the machine's RAM."""
    return int(min(CPU_DEFAULT_BYTES, CPU_MAX_RAM_FRACTION * system_memory_bytes()))


def cuda_kv_bytes(
    device: torch.device, utilization: float, baseline_used: int, peak_activation: int
) -> int:
    """KV bytes that fit in ``utilization`` of the GPU after weights and activations.

    ``baseline_used`` is the device memory in use (by anyone) before the warm-up forward and
    ``peak_activation`` the extra peak that forward allocated.
    """
    _, total = torch.cuda.mem_get_info(device)
    return int(total * utilization) - baseline_used - peak_activation


class KVCachePool:
    """The KV tensors for every layer (see the module docstring for the layout)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks
        shape = (num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim)
        if device.type == "cpu":
            # A fresh private anonymous mapping: zero-filled and committed on first write,
            # so a large pool costs nothing until it is used. Not on huge pages: a first
            # write inside a step could wait for the kernel to compact one (huge_pages.py).
            self.tensor = huge_pages.mapped_empty(shape, dtype, huge=False)
        else:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.bytes_per_block = kv_bytes_per_block(
            num_layers, block_size, num_kv_heads, head_dim, dtype
        )

    def release(self) -> None:
        """Drop the KV memory (the pool is unusable afterwards)."""
        self.tensor = torch.empty(0)

    @property
    def num_bytes(self) -> int:
        """Bytes of the scheduler-visible blocks (the scratch block excluded)."""
        return self.num_blocks * self.bytes_per_block

    def layer_caches(self) -> list[torch.Tensor]:
        """Per-layer views ``[2, num_blocks + 1, block_size, kv_heads, head_dim]``."""
        return list(self.tensor.unbind(0))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer, K and V): ``dst <- src`` for each pair, at once.

        Copy-on-write sources are never also destinations in the same step, so the order of
        the pairs does not matter.
        """
        if not copies:
            return
        dev = self.tensor.device
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=dev)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=dev)
        self.tensor[:, :, dst] = self.tensor[:, :, src]
