"""The interface every paged attention backend implements, and what CUDA graphs need from it.

A backend with ``supports_cuda_graphs`` promises, for pure-decode batches: after
``prepare_graph(meta)`` on metadata built by ``DecodeGraphBuffers.metadata``, ``forward``
reads the step only through the metadata's device tensors (sequence lengths, block tables,
slot mapping, query start offsets) and launches the same kernels with the same grid for any
batch of that size. A graph captured once then replays correctly after
``DecodeGraphBuffers.load`` has copied a new batch into those tensors. Nothing host-side
(``*_host`` arrays, ``max_seq_len``) may shape the launch beyond what ``prepare_graph`` fixed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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

    def prepare_graph(self, meta: AttentionMetadata) -> None:
        """Like ``prepare``, for a decode graph about to be captured over ``meta`` (see the
        module docstring); the state must hold for every batch the graph replays."""
        raise NotImplementedError(f"the {self.name} attention backend cannot be graph-captured")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write the step's new K/V into ``kv_cache``, then attend: ``[T, num_heads, head_dim]``.

        A cache of another dtype than the model's (``--kv-cache-dtype``): K/V are stored in
        the cache's dtype and attention computes in it, the output cast back to ``q``'s.
        """
        cache_dtype = kv_cache.dtype
        if q.dtype != cache_dtype:
            k, v = k.to(cache_dtype), v.to(cache_dtype)
            self.write_kv(k, v, kv_cache, meta.slot_mapping)
            return self.attend(q.to(cache_dtype), k, v, kv_cache, meta, scale).to(q.dtype)
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

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Store each row's K/V in its slot: one index op per tensor, no per-token work."""
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


@dataclass
class DecodeGraphBuffers:
    """The static inputs every captured decode graph reads, sized for the largest batch.

    Rows ``[n, size)`` of a batch of ``n`` replayed at bucket ``size`` are padding: token 0
    at position 0, writing its K/V into the scratch block, sequence length 1, a block table
    full of the scratch block, so padding never touches a real sequence's blocks.
    """

    # int64 [max_batch]: token ids and positions.
    input_ids: torch.Tensor
    positions: torch.Tensor
    # int64 [max_batch]: where each row's K/V are written.
    slot_mapping: torch.Tensor
    # int32 [max_batch], [max_batch, max_blocks], [max_batch + 1] (always 0, 1, 2, ...).
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    block_size: int
    scratch_block: int
    # Longest sequence a replay may hold (max_blocks * block_size at most).
    max_seq_len: int

    @classmethod
    def allocate(
        cls,
        max_batch_size: int,
        max_seq_len: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
    ) -> DecodeGraphBuffers:
        n = max_batch_size
        max_blocks = -(-max_seq_len // block_size)
        return cls(
            input_ids=torch.zeros(n, dtype=torch.long, device=device),
            positions=torch.zeros(n, dtype=torch.long, device=device),
            slot_mapping=torch.full(
                (n,), scratch_block * block_size, dtype=torch.long, device=device
            ),
            seq_lens=torch.ones(n, dtype=torch.int32, device=device),
            block_tables=torch.full(
                (n, max_blocks), scratch_block, dtype=torch.int32, device=device
            ),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            block_size=block_size,
            scratch_block=scratch_block,
            max_seq_len=max_seq_len,
        )

    def metadata(self, n: int) -> AttentionMetadata:
        """Decode metadata of ``n`` rows over the static tensors (capture a graph with it);
        its host arrays describe padding only and must not be read by a captured backend."""
        return AttentionMetadata(
            num_tokens=n,
            num_seqs=n,
            num_decodes=n,
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            block_size=self.block_size,
            query_start_loc=self.query_start_loc[: n + 1],
            seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n],
            slot_mapping=self.slot_mapping[:n],
            query_start_loc_host=np.arange(n + 1, dtype=np.int64),
            seq_lens_host=np.ones(n, np.int64),
            block_tables_host=np.full((n, 1), self.scratch_block, np.int64),
        )

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether ``meta`` (a decode batch) can be loaded into these buffers."""
        return (
            meta.all_decode
            and meta.num_seqs <= self.seq_lens.shape[0]
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def load(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        size: int,
    ) -> None:
        """Copy a decode batch of ``n`` rows into rows ``[0, n)``, padding ``[n, size)``."""
        n = meta.num_seqs
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:size].fill_(self.scratch_block)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(self.scratch_block * self.block_size)
            self.seq_lens[n:size].fill_(1)
