"""flash-attn paged attention for CUDA (upstream ``flash_attn`` 2.x).

- Pure decode steps: ``flash_attn_with_kvcache`` reads each sequence's keys and values
  straight from the paged cache through ``block_table`` (``cache_seqlens`` = lengths
  including the token just written). Static shapes: CUDA graphs capture this path.
- Prefill or mixed steps: ``flash_attn_varlen_func`` with ``block_table``: queries are the
  packed new rows, keys and values come from the paged cache (which already holds the new
  rows), ``cu_seqlens_k`` are cumulative sequence lengths. flash-attn aligns the causal mask
  to the bottom right, so a chunk with cached context attends causally at the right offset.

Upstream flash-attn requires the paged block size to be a multiple of 256 and a half dtype;
``attention.select_backend`` checks both before choosing this backend.
"""

from __future__ import annotations

import numpy as np
import torch

from pagectl.engine.attention.backend import AttentionBackend
from pagectl.engine.attention.metadata import AttentionMetadata


class FlashPagedAttention(AttentionBackend):
    name = "flash"
    supports_cuda_graphs = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.all_decode:
            meta.backend_state = None
            return
        cu = np.zeros(meta.num_seqs + 1, dtype=np.int32)
        np.cumsum(meta.seq_lens_host, out=cu[1:])
        meta.backend_state = torch.from_numpy(cu).to(self.device, non_blocking=True)

    def prepare_graph(self, meta: AttentionMetadata) -> None:
        # The decode path reads only meta's device tensors.
        meta.backend_state = None

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        q = q.contiguous()
        if meta.all_decode:
            out = self._with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables,
                softmax_scale=scale,
                causal=True,
            )
            return out.squeeze(1)
        return self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=meta.backend_state,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_tables,
        )
