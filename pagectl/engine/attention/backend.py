"""The interface every paged attention backend implements."""

from __future__ import annotations

import torch

from pagectl.engine.attention.metadata import AttentionMetadata


class AttentionBackend:
    """Writes a layer's new K/V into the paged cache and attends over each sequence's context.

    ``kv_cache`` of one layer is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    (index 0: keys, 1: values); ``q`` is ``[T, num_heads, head_dim]`` and ``k``/``v`` are
    ``[T, num_kv_heads, head_dim]`` (row strides may be anything, the last dim is contiguous).
    """

    name = "base"
    # Whether the decode path has static shapes (so a CUDA graph can capture it).
    supports_cuda_graphs = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def prepare(self, meta: AttentionMetadata) -> None:
        """Precompute per-step state shared by all layers into ``meta.backend_state``."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write the step's new K/V into ``kv_cache``, then attend: ``[T, num_heads, head_dim]``."""
        self.write_kv(k, v, kv_cache, meta.slot_mapping)
        return self.attend(q, k, v, kv_cache, meta, scale)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention output ``[T, num_heads, head_dim]``; ``kv_cache`` already holds this
        step's rows (``k``/``v`` are those rows, for backends that read them directly)."""
        raise NotImplementedError

    @staticmethod
    def write_kv(
        k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Store each row's K/V in its slot: one index op per tensor, no per-token work."""
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)
