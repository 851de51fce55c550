"""A warm-up forward at the step's largest shape, to measure activation memory on CUDA.

Runs one sequence of ``num_tokens`` fresh prompt tokens through the model with a throwaway
one-block KV cache (every row writes into its scratch block; a fresh prompt never reads the
cache), plus logits for ``num_logit_rows`` rows, and reports the peak memory it added.
"""

from __future__ import annotations

import numpy as np
import torch

from pagectl.engine.attention import select_backend
from pagectl.engine.attention.metadata import AttentionMetadata
from pagectl.engine.models.decoder import DecoderForCausalLM


def dummy_prefill_metadata(
    num_tokens: int, block_size: int, scratch_block: int, device: torch.device
) -> AttentionMetadata:
    nb = -(-num_tokens // block_size)
    cu = np.array([0, num_tokens], np.int64)
    seq_lens = np.array([num_tokens], np.int64)
    tables = np.full((1, nb), scratch_block, np.int64)
    slots = scratch_block * block_size + np.arange(num_tokens) % block_size

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a).to(device=device, dtype=dtype)

    return AttentionMetadata(
        num_tokens=num_tokens,
        num_seqs=1,
        num_decodes=0,
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        block_size=block_size,
        query_start_loc=dev(cu, torch.int32),
        seq_lens=dev(seq_lens, torch.int32),
        block_tables=dev(tables, torch.int32),
        slot_mapping=dev(slots, torch.int64),
        query_start_loc_host=cu,
        seq_lens_host=seq_lens,
        block_tables_host=tables,
    )


@torch.inference_mode()
def measure_peak_activation(
    model: DecoderForCausalLM,
    num_tokens: int,
    num_logit_rows: int,
    block_size: int,
    attention_backend: str,
    device: torch.device,
    kv_cache_dtype: torch.dtype | None = None,
) -> int:
    """Bytes of device memory a forward at ``num_tokens`` adds at its peak (CUDA only)."""
    attn = model.attention_layers[0]
    kv_dtype = kv_cache_dtype or model.dtype
    cache = torch.zeros(
        2, 1, block_size, attn.num_kv_heads, attn.head_dim, dtype=kv_dtype, device=device
    )
    backend = select_backend(
        attention_backend,
        device,
        block_size,
        kv_dtype,
        shape=(attn.num_heads, attn.num_kv_heads, attn.head_dim),
    )
    model.bind_kv_cache([cache] * len(model.attention_layers), backend)
    model.rotary_emb.ensure_cache(num_tokens, device)
    meta = dummy_prefill_metadata(num_tokens, block_size, 0, device)
    backend.prepare(meta)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    hidden = model(ids, positions, meta)
    rows = torch.arange(min(num_logit_rows, num_tokens), device=device)
    logits = model.compute_logits(hidden.index_select(0, rows))
    if logits is not None:  # None on tensor-parallel ranks other than 0
        logits.softmax(-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    for layer in model.attention_layers:
        layer.kv_cache = None
    del cache, hidden
    torch.cuda.empty_cache()
    return int(peak)
