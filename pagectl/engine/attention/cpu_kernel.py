"""Paged attention on CPU with a compiled kernel for the decode rows.

Decode rows (one query each) go to ``torch.ops.pagectl_cpu.paged_decode``
(``csrc/paged_attention_cpu.cpp``), which reads each sequence's keys and values in place
through its block table: no gathered copy, no padding to a group's longest sequence, and
the query heads of a GQA group share each K/V read. Prefill rows stay on the torch
backend's path (one SDPA per sequence): they are few per step and compute-bound, where
SDPA's blocked matmuls beat a row-by-row kernel.

The kernel is built on first use (``cpu_build.py``); ``attention.select_backend`` picks
this backend for "auto" on CPU only when the kernel loads and passes a self-check.
"""

from __future__ import annotations

from typing import Any

import torch

from pagectl.engine.attention.metadata import AttentionMetadata
from pagectl.engine.attention.torch_paged import DecodeGroup, TorchPagedAttention

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CpuKernelPagedAttention(TorchPagedAttention):
    name = "cpu-kernel"

    def __init__(self, device: torch.device, ops: Any) -> None:
        """``ops``: the loaded ``torch.ops.pagectl_cpu`` namespace."""
        super().__init__(device)
        self._decode = ops.paged_decode

    def plan_decode_groups(self, meta: AttentionMetadata) -> list[DecodeGroup]:
        # The kernel needs nothing beyond the metadata's block tables and lengths.
        return []

    def attend_decodes(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        nd = meta.num_decodes
        if nd != q.shape[0]:  # a pure decode step needs no slices
            q, out = q[:nd], out[:nd]
        self._decode(q, kv_cache, meta.block_tables, meta.seq_lens, scale, out)


def self_check(ops: Any) -> str | None:
    """Run the kernel once on a small random paged batch against plain attention.

    Returns None when it agrees, else what went wrong (a build that miscompiles must not be
    used).
    """
    try:
        g = torch.Generator().manual_seed(0)
        block_size, kv_heads, group, head_dim = 4, 2, 2, 16
        lens = [1, 5, 9]
        num_blocks = sum(-(-n // block_size) for n in lens) + 1
        cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
        perm = torch.randperm(num_blocks - 1, generator=g).tolist()
        width = max(-(-n // block_size) for n in lens)
        tables = torch.full((len(lens), width), num_blocks - 1, dtype=torch.int32)
        for i, n in enumerate(lens):
            for j in range(-(-n // block_size)):
                tables[i, j] = perm.pop()
        q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g)
        out = torch.empty_like(q)
        scale = head_dim**-0.5
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        ops.paged_decode(q, cache, tables, seq_lens, scale, out)
        for i, n in enumerate(lens):
            blocks = tables[i, : -(-n // block_size)].long()
            keys = cache[0, blocks].reshape(-1, kv_heads, head_dim)[:n]
            values = cache[1, blocks].reshape(-1, kv_heads, head_dim)[:n]
            keys = keys.repeat_interleave(group, 1).transpose(0, 1)
            values = values.repeat_interleave(group, 1).transpose(0, 1)
            weights = (q[i].unsqueeze(1) @ keys.transpose(1, 2) * scale).softmax(-1)
            want = (weights @ values).squeeze(1)
            if not torch.allclose(out[i], want, rtol=1e-4, atol=1e-5):
                return "the kernel's output differs from plain attention"
    except Exception as e:  # any failure disqualifies the kernel
        return f"the kernel failed its self-check: {e}"
    return None
