"""Triton kernels for paged attention: attend through the block table, and write K/V slots.

Importing this module imports triton; ``@triton.jit`` decides at import whether the kernels
compile for the GPU or run in Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors), so
``triton_paged.load_kernels`` sets the environment before the first import.

Only long-stable Triton language features are used (``tl.dot``, ``tl.where``, ``tl.exp2``,
loops with runtime bounds, constexpr branches), so the kernels build on Triton 3.x alike.
No helper that is itself a ``@triton.jit`` function (``tl.cdiv``): if triton was imported
before ``TRITON_INTERPRET`` was set, those helpers are compiled-mode objects that the
interpreter cannot call.

``paged_attention_kernel``: one program = one KV head x one tile of queries of one
sequence. Its ``BLOCK_M`` rows are (query token, query head of the KV head's GQA group)
pairs, row ``r`` -> token ``r // G_PAD``, head ``r % G_PAD``; rows past the tile or the
group are masked. Keys are read in tiles of ``TILE_N`` positions straight from the paged
cache: position ``p`` of sequence ``s`` lives in block ``block_tables[s, p // block_size]``
at offset ``p % block_size``, so any block size works and no K/V is copied. Row ``r`` at
absolute position ``c`` sees keys ``0..c`` (causal within the chunk, everything cached
before it). Softmax is online in float32 (base 2, the scale folded into ``qk_scale``).
Dots accumulate in float32; float32 inputs use IEEE precision (``IEEE``), never TF32.
``DOT_F32`` (the interpreter with bfloat16 only) upcasts dot operands to float32: Triton
3.9's interpreter multiplies bfloat16 operands wrongly, and a bfloat16 product is exact in
float32, so only the summation order differs from the GPU.

Split-K (decode): with ``NUM_SPLITS > 1`` each program covers one contiguous share of the
sequence's key tiles and writes its unnormalised partial output, running max and sum to
float32 scratch; ``combine_splits_kernel`` merges the shares. The share is derived from the
sequence length read on the device, so a captured CUDA graph stays valid for any length.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Running max before any key is seen: finite, so fully masked rows never make NaN
# (exp2(-inf - MIN) == 0, exp2(MIN - MIN) == 1).
NEG_INIT = -1.0e30


@triton.jit
def paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tile_seq_ptr,
    tile_q_ptr,
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    qk_scale,
    block_size,
    num_queries_per_kv,
    head_dim,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt,
    DECODE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        # One program per decode sequence: the sequence is the program id, one query row.
        seq = pid
        q_tile = 0
    else:
        seq = tl.load(tile_seq_ptr + pid)
        q_tile = tl.load(tile_q_ptr + pid)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = rows // G_PAD
    head_in_group = rows % G_PAD
    q_idx = q_tile + tok
    row_valid = (tok < BLOCK_Q) & (q_idx < q_len) & (head_in_group < num_queries_per_kv)
    head = kv_head * num_queries_per_kv + head_in_group
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < head_dim

    q_offs = (q_begin + q_idx)[:, None] * stride_q_tok + head[:, None] * stride_q_head
    q = tl.load(
        q_ptr + q_offs + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0
    )
    # Absolute position of each row; keys past it (or past the tile's last row) are unseen.
    row_pos = context_len + q_idx
    last_pos = tl.minimum(seq_len, context_len + q_tile + BLOCK_Q) - 1
    num_tiles = (last_pos + TILE_N) // TILE_N
    tile_begin = 0
    tile_end = num_tiles
    if NUM_SPLITS > 1:
        per_split = (num_tiles + NUM_SPLITS - 1) // NUM_SPLITS
        tile_begin = split * per_split
        tile_end = tl.minimum(num_tiles, tile_begin + per_split)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + NEG_INIT
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    cols = tl.arange(0, TILE_N)
    for t in range(tile_begin, tile_end):
        pos = t * TILE_N + cols
        pos_valid = pos <= last_pos
        block = tl.load(
            block_tables_ptr + seq * stride_bt + pos // block_size, mask=pos_valid, other=0
        )
        kv_offs = (
            block.to(tl.int64)[:, None] * stride_c_block
            + (pos % block_size)[:, None] * stride_c_slot
            + kv_head * stride_c_head
            + dims[None, :]
        )
        kv_mask = pos_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        elif DOT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k).to(tl.float32))
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        visible = (pos[None, :] <= row_pos[:, None]) & pos_valid[None, :] & row_valid[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        elif DOT_F32:
            # p rounded to the K/V dtype first, as the GPU path does.
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS > 1:
        # Partials [num_seqs, num_heads, NUM_SPLITS, (HEAD_DIM_PAD)]; decode has one row per
        # head, so (seq, head, split) addresses a row.
        num_heads = tl.num_programs(1) * num_queries_per_kv
        part = (seq * num_heads + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
        tl.store(
            part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :],
            acc,
            mask=row_valid[:, None],
        )
    else:
        # Every valid row saw at least key 0, so l_i > 0 there.
        out = acc / tl.where(row_valid, l_i, 1.0)[:, None]
        o_offs = (q_begin + q_idx)[:, None] * stride_o_tok + head[:, None] * stride_o_head
        tl.store(out_ptr + o_offs + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def combine_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    head_dim,
    stride_o_tok,
    stride_o_head,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """One program per (decode sequence, query head): merge its split-K partials."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    base = (seq * num_heads + head) * NUM_SPLITS
    m = tl.load(part_m_ptr + base + splits)
    l_part = tl.load(part_l_ptr + base + splits)
    acc = tl.load(part_out_ptr + (base + splits)[:, None] * HEAD_DIM_PAD + dims[None, :])
    # Splits that saw no key hold m = NEG_INIT and l = 0: their weight is 0 (split 0 always
    # sees key 0, so the maximum is a real one).
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)
    total = tl.sum(l_part * w, 0)
    out = tl.sum(acc * w[:, None], 0) / total
    tl.store(
        out_ptr + seq * stride_o_tok + head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )


@triton.jit
def write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    num_kv_heads,
    head_dim,
    block_size,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    BLOCK_T: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """One program per ``BLOCK_T`` token rows: store their K and V (every KV head) in their
    slots. Columns are (KV head, dim) pairs, column ``c`` -> head ``c // HEAD_DIM_PAD``."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_valid = toks < num_tokens
    slot = tl.load(slot_mapping_ptr + toks, mask=tok_valid, other=0)
    cols = tl.arange(0, HEADS_PAD * HEAD_DIM_PAD)
    heads = cols // HEAD_DIM_PAD
    dims = cols % HEAD_DIM_PAD
    mask = tok_valid[:, None] & ((heads < num_kv_heads) & (dims < head_dim))[None, :]
    rows = toks.to(tl.int64)[:, None]
    src_k = k_ptr + rows * stride_k_tok + (heads * stride_k_head + dims)[None, :]
    src_v = v_ptr + rows * stride_v_tok + (heads * stride_v_head + dims)[None, :]
    dst = (
        (slot // block_size)[:, None] * stride_c_block
        + (slot % block_size)[:, None] * stride_c_slot
        + (heads * stride_c_head + dims)[None, :]
    )
    tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)
