"""Attention metadata: how one step's batch is laid out, shared by every layer.

Built once per step by the runner (``runner/input_batch.py``) and read by the attention
backend of every layer. Invariants:

- token rows are grouped by sequence in batch order: sequence ``i`` owns rows
  ``[query_start_loc[i], query_start_loc[i + 1])``, at positions
  ``[seq_lens[i] - query_len_i, seq_lens[i])``;
- the first ``num_decodes`` sequences have exactly one row each (decode rows), sorted by
  ascending ``seq_lens``; the rest have at least two (prefill or chunked-prefill rows);
- ``block_tables[i, j]`` is the physical block holding positions
  ``[j * block_size, (j + 1) * block_size)`` of sequence ``i``; entries past the sequence's
  blocks hold the scratch block id (a real block no sequence owns), so gathers never go out
  of range;
- ``slot_mapping[t] = block * block_size + offset`` is where row ``t``'s K/V are written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    # Rows of q / k / v this step, and sequences they belong to.
    num_tokens: int
    num_seqs: int
    # Leading sequences with a single row (see the module invariants).
    num_decodes: int
    # Longest query (rows of one sequence) and longest sequence (cached + new) this step.
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Device tensors: int32 [num_seqs + 1], int32 [num_seqs], int32 [num_seqs, max_blocks],
    # int64 [num_tokens].
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    # Host copies (numpy int64) of query_start_loc, seq_lens and the padded block tables.
    query_start_loc_host: np.ndarray
    seq_lens_host: np.ndarray
    block_tables_host: np.ndarray
    # Dynamic NTK rope only: each row's sequence length after this step (device, int64).
    token_seq_lens: torch.Tensor | None = None
    # Whatever the backend precomputed for this step in ``prepare`` (gather indices, masks).
    backend_state: Any = None

    @property
    def all_decode(self) -> bool:
        """Every sequence feeds exactly one token (a pure decode step)."""
        return self.num_decodes == self.num_seqs
