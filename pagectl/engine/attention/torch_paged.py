"""Torch-native paged attention: runs on CPU and CUDA with stock PyTorch ops.

Per layer and step:

1. new K/V rows are written to their slots with one ``index_copy_`` per tensor;
2. decode rows (one query each, sorted by length) are attended in a few groups: each group
   gathers its sequences' blocks with one ``index_select`` per K and V (padded to the group's
   longest sequence; sorting keeps the padding small) and runs one batched SDPA with a length
   mask, the query heads of each KV head stacked as rows (GQA without re-reading K/V). Groups
   are capped in size so the gathered K/V stays cache-resident on CPU;
3. prefill rows run one SDPA per sequence: a fresh prompt attends to its own new K/V
   directly (causal, no gather); a chunk with cached context gathers only that sequence's
   blocks and uses a causal mask offset by the context length.

Masks and gather indices are built once per step in ``prepare`` and shared by all layers.
KV tensors must hold finite values everywhere (the runner zero-fills them): masked padding
still flows through the matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagectl.engine.attention.backend import AttentionBackend
from pagectl.engine.attention.metadata import AttentionMetadata


@dataclass
class DecodeGroup:
    # Decode sequences [start, end) (equal to their rows), padded to num_blocks blocks each.
    start: int
    end: int
    num_blocks: int
    # int64 [n * num_blocks]: the blocks to gather, row-major over (sequence, block).
    blocks: torch.Tensor
    # bool [n, 1, 1, num_blocks * block_size]: True where a key position is < the seq length.
    mask: torch.Tensor


@dataclass
class PrefillSeq:
    # Rows [q_start, q_end) of this sequence; its length after the step; cached context.
    q_start: int
    q_end: int
    seq_len: int
    context_len: int
    # With context only: int64 blocks holding positions [0, seq_len), and the causal mask
    # bool [q_len, seq_len] (row r sees keys <= context_len + r).
    blocks: torch.Tensor | None
    mask: torch.Tensor | None


def prefill_keys_values(
    p: PrefillSeq, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values ``[seq_len, KH, head_dim]`` a prefill attends: the step's own K/V
    rows for a fresh prompt, else the sequence's blocks gathered from the cache (which
    already holds the step's rows)."""
    if p.blocks is None:
        return k[p.q_start : p.q_end], v[p.q_start : p.q_end]
    kv_heads, head_dim = kv_cache.shape[-2:]
    keys = kv_cache[0].index_select(0, p.blocks).view(-1, kv_heads, head_dim)
    values = kv_cache[1].index_select(0, p.blocks).view(-1, kv_heads, head_dim)
    return keys[: p.seq_len], values[: p.seq_len]


@dataclass
class TorchAttentionState:
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSeq]


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    # CPU: K+V bytes one decode group may gather, so the copy stays cache-resident (the
    # caps measured: docs/MODEL_EXECUTION.md, "Performance on CPU").
    CPU_GROUP_BYTES = 4 << 20

    def __init__(
        self,
        device: torch.device,
        decode_group_tokens: int | None = None,
        kv_bytes_per_token: int | None = None,
    ) -> None:
        """``decode_group_tokens``: most key positions (sequences x padded length) gathered at
        once for decode rows; by default derived from ``kv_bytes_per_token`` (one layer's K+V
        for one token) on CPU, unbounded in practice on CUDA."""
        super().__init__(device)
        if decode_group_tokens is None:
            if device.type == "cpu":
                per_token = kv_bytes_per_token or 2048
                decode_group_tokens = max(256, self.CPU_GROUP_BYTES // per_token)
            else:
                decode_group_tokens = 1 << 22
        self.decode_group_tokens = decode_group_tokens

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.backend_state = TorchAttentionState(
            self.plan_decode_groups(meta), self.plan_prefills(meta)
        )

    def plan_decode_groups(self, meta: AttentionMetadata) -> list[DecodeGroup]:
        """Gather groups for the decode rows, longest sequences first."""
        bs = meta.block_size
        dev = self.device
        seq_lens = meta.seq_lens_host
        tables = meta.block_tables_host
        groups: list[DecodeGroup] = []
        # Decode sequences are sorted by length: walk from the longest down, closing a group
        # when adding one more sequence would exceed the gather budget.
        end = meta.num_decodes
        while end > 0:
            nb = -(-int(seq_lens[end - 1]) // bs)
            per_seq = max(nb * bs, 1)
            n = max(1, min(end, self.decode_group_tokens // per_seq))
            start = end - n
            blocks = np.ascontiguousarray(tables[start:end, :nb]).reshape(-1)
            key_pos = np.arange(nb * bs)
            mask = key_pos[None, :] < seq_lens[start:end, None]
            groups.append(
                DecodeGroup(
                    start,
                    end,
                    nb,
                    torch.from_numpy(blocks).to(dev, non_blocking=True),
                    torch.from_numpy(mask).view(n, 1, 1, nb * bs).to(dev, non_blocking=True),
                )
            )
            end = start
        return groups

    def plan_prefills(self, meta: AttentionMetadata) -> list[PrefillSeq]:
        """One entry per prefill sequence (the rows after the decodes)."""
        bs = meta.block_size
        dev = self.device
        seq_lens = meta.seq_lens_host
        qsl = meta.query_start_loc_host
        tables = meta.block_tables_host
        prefills: list[PrefillSeq] = []
        for i in range(meta.num_decodes, meta.num_seqs):
            q_start, q_end = int(qsl[i]), int(qsl[i + 1])
            seq_len = int(seq_lens[i])
            ctx = seq_len - (q_end - q_start)
            seq_blocks: torch.Tensor | None = None
            causal: torch.Tensor | None = None
            if ctx > 0:
                nb = -(-seq_len // bs)
                seq_blocks = torch.from_numpy(np.ascontiguousarray(tables[i, :nb])).to(dev)
                rows = ctx + np.arange(q_end - q_start)
                visible = np.arange(seq_len)[None, :] <= rows[:, None]
                causal = torch.from_numpy(visible).to(dev, non_blocking=True)
            prefills.append(PrefillSeq(q_start, q_end, seq_len, ctx, seq_blocks, causal))
        return prefills

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        state: TorchAttentionState = meta.backend_state
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            self.attend_decodes(q, kv_cache, meta, scale, out)
        self.attend_prefills(q, k, v, kv_cache, state.prefills, scale, out)
        return out

    def attend_decodes(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Decode rows (the first ``meta.num_decodes``), one gather and one SDPA per group,
        into ``out``."""
        _, num_heads, head_dim = q.shape
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_kv_heads = k_cache.shape[-2]
        group = num_heads // num_kv_heads
        for g in meta.backend_state.decode_groups:
            n = g.end - g.start
            keys = k_cache.index_select(0, g.blocks).view(n, -1, num_kv_heads, head_dim)
            values = v_cache.index_select(0, g.blocks).view(n, -1, num_kv_heads, head_dim)
            # The query heads sharing a KV head form a G-row "query" over that head (one
            # position, so no causal mask): each K/V head is read once, not G times.
            o = F.scaled_dot_product_attention(
                q[g.start : g.end].view(n, num_kv_heads, group, head_dim),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=g.mask,
                scale=scale,
            )
            out[g.start : g.end] = o.view(n, num_heads, head_dim)

    @staticmethod
    def attend_prefills(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        prefills: list[PrefillSeq],
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Prefill rows, one SDPA per sequence, into ``out``."""
        gqa = q.shape[1] != kv_cache.shape[-2]
        for p in prefills:
            qs = q[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)
            keys, values = prefill_keys_values(p, k, v, kv_cache)
            o = F.scaled_dot_product_attention(
                qs,
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=scale,
                enable_gqa=gqa,
            )
            out[p.q_start : p.q_end] = o[0].transpose(0, 1)
