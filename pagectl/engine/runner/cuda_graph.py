"""CUDA graphs for pure-decode steps (CUDA with a static-shape attention backend only).

A decode step of ``n`` sequences replays the graph captured for the smallest bucket size
``>= n`` (1, 2, 4, 8, then multiples of 16 up to ``max_batch_size``). Every captured graph
reads the same static input buffers; rows ``[n, bucket)`` are padding: token 0 at position 0,
writing its K/V into the scratch block, with a sequence length of 1 and a block table full of
the scratch block, so padding never touches a real sequence's blocks.

Only the model body is captured; the LM head runs eagerly on the rows that sample.
Disabled by ``enforce_eager``; never used for dynamic NTK rope (its frequencies depend on
host-side lengths).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagectl.engine.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from pagectl.engine.runner.input_batch import StepBatch
    from pagectl.engine.runner.model_runner import ModelRunner


def bucket_sizes(max_batch_size: int) -> list[int]:
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch_size}
    sizes.update(range(16, max_batch_size + 1, 16))
    sizes.add(max_batch_size)
    return sorted(sizes)


class DecodeCudaGraphs:
    def __init__(self, runner: ModelRunner, max_batch_size: int) -> None:
        self.runner = runner
        self.sizes = bucket_sizes(max_batch_size)
        self.max_batch_size = self.sizes[-1]
        dev = runner.device
        bs = runner.block_size
        self.scratch_block = runner.kv.scratch_block
        self.scratch_slot = self.scratch_block * bs
        max_blocks = -(-runner.max_model_len // bs)
        n = self.max_batch_size
        # Static inputs shared by every graph (see the module docstring for padding rows).
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.full(
            (n, max_blocks), self.scratch_block, dtype=torch.int32, device=dev
        )
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _meta(self, n: int) -> AttentionMetadata:
        ones = np.ones(n, np.int64)
        return AttentionMetadata(
            num_tokens=n,
            num_seqs=n,
            num_decodes=n,
            max_query_len=1,
            max_seq_len=self.runner.max_model_len,
            block_size=self.runner.block_size,
            query_start_loc=self.query_start_loc[: n + 1],
            seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n],
            slot_mapping=self.slot_mapping[:n],
            query_start_loc_host=np.arange(n + 1, dtype=np.int64),
            seq_lens_host=ones,
            block_tables_host=np.full((n, 1), self.scratch_block, np.int64),
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first (later ones reuse its memory pool)."""
        model = self.runner.model
        backend = self.runner.backend
        pool = None
        for n in reversed(self.sizes):
            meta = self._meta(n)
            backend.prepare(meta)
            model(self.input_ids[:n], self.positions[:n], meta)  # warm-up outside the graph
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = model(self.input_ids[:n], self.positions[:n], meta)
            if pool is None:
                pool = graph.pool()
            self._graphs[n] = (graph, out)
        torch.cuda.synchronize(self.runner.device)

    def can_run(self, batch: StepBatch) -> bool:
        m = batch.meta
        return (
            m.all_decode
            and m.num_seqs <= self.max_batch_size
            and m.token_seq_lens is None
            and m.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Replay the bucket for ``batch``; returns the hidden rows ``[n, hidden]``."""
        m = batch.meta
        n = m.num_seqs
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(m.slot_mapping)
        self.seq_lens[:n].copy_(m.seq_lens)
        self.block_tables[:size].fill_(self.scratch_block)
        self.block_tables[:n, : m.block_tables.shape[1]].copy_(m.block_tables)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(self.scratch_slot)
            self.seq_lens[n:size].fill_(1)
        graph, out = self._graphs[size]
        graph.replay()
        return out[:n]
