"""Vocab-parallel token embedding and LM head.

Each rank owns a contiguous range of ``ceil(vocab / tp)`` rows (the last range may be short;
its missing rows are zero). The embedding looks up the ids in its range, zeroes the rest and
all-reduces; the LM head computes logits for its range and rank 0 gathers them (sampling
happens there). At tp size 1 both are a plain lookup / matmul.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagectl.engine import huge_pages
from pagectl.engine.models.linear import PackableLinear
from pagectl.engine.models.parallel import SINGLE, TPGroup
from pagectl.engine.models.weights import copy_checked, read, set_weight_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TPGroup = SINGLE,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(
            huge_pages.empty((self.rows_per_rank, embedding_dim), params_dtype),
            requires_grad=False,
        )
        set_weight_loader(self.weight, self.weight_loader)
        # The rows in the CPU kernel's packed bfloat16 layout [rows / 64, dim / 2, 64, 2],
        # when a tied LM head packed the shared weight (``weight`` is then empty).
        self._packed_rows: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        n = max(self.vocab_end - self.vocab_start, 0)
        if n < param.shape[0]:
            param.data[n:].zero_()
        copy_checked(param.data[:n], read(loaded, 0, self.vocab_start, n))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        packed = self._packed_rows
        if packed is None:
            return F.embedding(ids, self.weight)
        # Row r lies in tile r // 64, column r % 64: its (dim / 2) pairs, gathered.
        cols = packed.shape[2]
        rows = packed[ids // cols, :, ids % cols]  # [..., dim / 2, 2]
        return rows.reshape(*ids.shape, -1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(input_ids)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = (input_ids - self.vocab_start) * mask
        out = self._lookup(local)
        out = out * mask.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, PackableLinear):
    """The output projection; shares its parameter with the embedding when tied."""

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.weight_is_shared = True
        # A plain reference, not a child module (the embedding is registered in the model).
        self._tied_to: tuple[VocabParallelEmbedding, ...] = (embedding,)

    def _share_packed(self, packed: torch.Tensor) -> None:
        # One copy of the shared rows: the embedding gathers its rows from the packed layout.
        if self.weight_is_shared:
            self._tied_to[0]._packed_rows = packed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary, in float32, for the given hidden rows.

        With tensor parallelism each rank computes its vocabulary range and rank 0 (where
        sampling happens) gathers them; the other ranks get None.
        """
        logits = self._matmul(hidden, None)
        if self.tp.size > 1:
            gathered = self.tp.gather(logits, dim=-1)
            if gathered is None:
                return None
            logits = gathered[..., : self.num_embeddings]
        return logits.float()
