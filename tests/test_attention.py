"""The torch paged attention backend against dense per-sequence attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from paged_layout import paged_metadata

from pagectl.engine.attention import TorchPagedAttention, select_backend


def dense_reference(q_rows, keys, values, context_len, scale):
    """Causal attention of q_rows [n, H, D] at positions context_len.. over keys [L, Hkv, D]."""
    n, heads, _ = q_rows.shape
    rep = heads // keys.shape[1]
    k = keys.repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.repeat_interleave(rep, dim=1).transpose(0, 1)
    scores = torch.einsum("nhd,hld->hnl", q_rows.double(), k.double()) * scale
    pos = context_len + torch.arange(n)
    mask = torch.arange(keys.shape[0])[None, :] > pos[:, None]
    scores.masked_fill_(mask[None], float("-inf"))
    return torch.einsum("hnl,hld->nhd", scores.softmax(-1), v.double()).float()


def make_batch(seqs, block_size, num_blocks, heads, kv_heads, head_dim, seed=0):
    """seqs: list of (context_len, query_len) with decodes (query_len 1) first, sorted.

    Returns the KV cache (context already written), per-sequence full K/V, q/k/v for the new
    rows and the metadata, with blocks scattered randomly over the pool.
    """
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(2, num_blocks + 1, block_size, kv_heads, head_dim)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, full_k, full_v, slots = [], [], [], []
    q_parts, k_parts, v_parts = [], [], []
    for ctx, qlen in seqs:
        total = ctx + qlen
        nb = -(-total // block_size)
        blocks = [free.pop() for _ in range(nb)]
        tables.append(blocks)
        k = torch.randn(total, kv_heads, head_dim, generator=g)
        v = torch.randn(total, kv_heads, head_dim, generator=g)
        full_k.append(k)
        full_v.append(v)
        for p in range(total):
            b, off = blocks[p // block_size], p % block_size
            if p < ctx:  # cached context
                cache[0, b, off] = k[p]
                cache[1, b, off] = v[p]
            else:
                slots.append(b * block_size + off)
        q_parts.append(torch.randn(qlen, heads, head_dim, generator=g))
        k_parts.append(k[ctx:])
        v_parts.append(v[ctx:])
    meta = paged_metadata(seqs, tables, slots, num_blocks, block_size)
    return cache, full_k, full_v, torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts), meta


@pytest.mark.parametrize(
    "block_size,heads,kv_heads,head_dim,group_tokens",
    [(16, 8, 4, 32, None), (4, 4, 1, 16, 64), (32, 6, 6, 8, 32), (1, 4, 2, 8, None)],
)
def test_mixed_batch_matches_dense(block_size, heads, kv_heads, head_dim, group_tokens):
    # Decodes sorted by length, then fresh prompts, chunks with context, a 1-token context.
    seqs = [(0, 1), (3, 1), (17, 1), (40, 1), (63, 1), (0, 9), (21, 7), (1, 2), (0, 33), (48, 16)]
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 8
    cache, full_k, full_v, q, k, v, meta = make_batch(
        seqs, block_size, num_blocks, heads, kv_heads, head_dim
    )
    backend = TorchPagedAttention(torch.device("cpu"), decode_group_tokens=group_tokens)
    backend.prepare(meta)
    scale = head_dim**-0.5
    out = backend.forward(q, k, v, cache, meta, scale)
    assert out.shape == (meta.num_tokens, heads, head_dim)
    cu = meta.query_start_loc_host
    for i, (ctx, _) in enumerate(seqs):
        ref = dense_reference(q[cu[i] : cu[i + 1]], full_k[i], full_v[i], ctx, scale)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], ref, atol=2e-5, rtol=1e-4)


def test_new_rows_land_in_their_slots():
    seqs = [(5, 1), (0, 6)]
    cache, full_k, full_v, q, k, v, meta = make_batch(seqs, 4, 16, 2, 2, 8)
    backend = TorchPagedAttention(torch.device("cpu"))
    backend.prepare(meta)
    backend.forward(q, k, v, cache, meta, 1.0)
    flat_k = cache[0].reshape(-1, 2, 8)
    flat_v = cache[1].reshape(-1, 2, 8)
    torch.testing.assert_close(flat_k[meta.slot_mapping], k, rtol=0, atol=0)
    torch.testing.assert_close(flat_v[meta.slot_mapping], v, rtol=0, atol=0)
    # The scratch block (id 16) is never written by real rows.
    assert cache[:, 16].abs().sum() == 0


def test_decode_groups_split_by_budget():
    seqs = [(c, 1) for c in (2, 9, 14, 30, 31, 60)]
    _, _, _, _, _, _, meta = make_batch(seqs, 4, 64, 2, 1, 8)
    backend = TorchPagedAttention(torch.device("cpu"), decode_group_tokens=64)
    backend.prepare(meta)
    groups = meta.backend_state.decode_groups
    # Longest first; each group pads to its longest sequence and stays within 64 key slots
    # unless a single sequence alone is longer.
    assert [(g.start, g.end, g.num_blocks) for g in groups] == [(5, 6, 16), (3, 5, 8), (0, 3, 4)]
    assert groups[0].mask.shape == (1, 1, 1, 64)
    assert int(groups[2].mask.sum()) == 3 + 10 + 15


def test_sdpa_reference_agrees_with_dense():
    # The reference itself against torch SDPA on one plain causal sequence.
    g = torch.Generator().manual_seed(1)
    q = torch.randn(7, 4, 8, generator=g)
    k = torch.randn(7, 2, 8, generator=g)
    v = torch.randn(7, 2, 8, generator=g)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(dense_reference(q, k, v, 0, 8**-0.5), ref, atol=1e-5, rtol=1e-4)


def test_backend_selection():
    cpu = torch.device("cpu")
    # auto on CPU: the compiled kernel when it builds here, else the torch backend.
    assert select_backend("auto", cpu, 16, torch.float32).name in ("cpu-kernel", "torch")
    assert select_backend("torch", cpu, 16, torch.float32).name == "torch"
    with pytest.raises(ValueError, match="not cuda"):
        select_backend("flash", cpu, 256, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 256"):
        select_backend("flash", cpu, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="auto, torch, cpu-kernel, triton, flash"):
        select_backend("xformers", cpu, 16, torch.float32)
