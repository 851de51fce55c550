"""The attention metadata of a paged batch, shared by the attention backend tests."""

from __future__ import annotations

import numpy as np
import torch

from pagectl.engine.attention.metadata import AttentionMetadata


def paged_metadata(
    seqs: list[tuple[int, int]],
    tables: list[list[int]],
    slots: list[int],
    num_blocks: int,
    block_size: int,
) -> AttentionMetadata:
    """``seqs``: (context tokens, query tokens) per sequence; ``tables``: its block ids;
    ``slots``: the cache slot of every query token. Block tables are padded with
    ``num_blocks`` (an id past the pool)."""
    q_lens = np.array([q for _, q in seqs])
    seq_lens = np.array([c + q for c, q in seqs])
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    tab = np.full((len(seqs), max(len(t) for t in tables)), num_blocks, np.int64)
    for i, t in enumerate(tables):
        tab[i, : len(t)] = t
    return AttentionMetadata(
        num_tokens=int(cu[-1]),
        num_seqs=len(seqs),
        num_decodes=sum(1 for _, q in seqs if q == 1),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_size=block_size,
        query_start_loc=torch.from_numpy(cu.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        block_tables=torch.from_numpy(tab.astype(np.int32)),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc_host=cu,
        seq_lens_host=seq_lens,
        block_tables_host=tab,
    )
