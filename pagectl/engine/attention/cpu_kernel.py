"""Paged attention on CPU with a compiled kernel for the decode rows.

Decode rows (one query each) go to ``torch.ops.pagectl_cpu.paged_decode``
(``csrc/paged_attention_cpu.cpp``), which reads each sequence's keys and values in place
through its block table: no gathered copy, no padding to a group's longest sequence, and
the query heads of a GQA group share each K/V read. Prefill rows go, one sequence at a time,
to ``torch.ops.pagectl_cpu.prefill_attention`` (``csrc/prefill_attention_cpu.cpp``: key
tiles shared by blocks of query rows, causal with the cached context), over the step's own
K/V or, with cached context, the sequence's K/V gathered from its blocks as the torch
backend gathers them; where it does not apply (float16, a head size it lacks, a build it
is slower than SDPA in: ``prefill_attention_fast``, below) they take the torch backend's SDPA.

The kernel is built on first use (``cpu_build.py``); ``attention.select_backend`` picks
this backend for "auto" on CPU only when the kernel loads and passes a self-check.
"""

from __future__ import annotations

from typing import Any

import torch

from pagectl.engine.attention.metadata import AttentionMetadata
from pagectl.engine.attention.torch_paged import (
    DecodeGroup,
    PrefillSeq,
    TorchPagedAttention,
    prefill_keys_values,
)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# What prefill_attention takes (csrc/prefill_attention_cpu.cpp); the rest keeps SDPA.
PREFILL_DTYPES = (torch.float32, torch.bfloat16)
PREFILL_HEAD_DIMS = frozenset([*range(16, 129, 16), 192, 256])


class CpuKernelPagedAttention(TorchPagedAttention):
    name = "cpu-kernel"

    def __init__(self, device: torch.device, ops: Any, prefill_rule: int | None = None) -> None:
        """``ops``: the loaded ``torch.ops.pagectl_cpu`` namespace. ``prefill_rule``: which
        prefills take the prefill kernel, 2 every one, 1 those without cached context, 0 none;
        None (the engine's choice) takes where it beats SDPA in this build,
        ``prefill_attention_fast()`` (2 on AVX-512, 1 on AVX2). Benchmarks and tests pass 2
        to run the kernel everywhere."""
        super().__init__(device)
        self._decode = ops.paged_decode
        self._prefill = ops.prefill_attention
        self._prefill_rule = (
            int(ops.prefill_attention_fast()) if prefill_rule is None else prefill_rule
        )

    def attend_prefills(  # type: ignore[override]
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        prefills: list[PrefillSeq],
        scale: float,
        out: torch.Tensor,
    ) -> None:
        if (
            self._prefill_rule == 0
            or q.dtype not in PREFILL_DTYPES
            or not (k.dtype == v.dtype == kv_cache.dtype == out.dtype == q.dtype)
            or q.shape[-1] not in PREFILL_HEAD_DIMS
        ):
            TorchPagedAttention.attend_prefills(q, k, v, kv_cache, prefills, scale, out)
            return
        for p in prefills:
            if p.blocks is not None and self._prefill_rule < 2:
                TorchPagedAttention.attend_prefills(q, k, v, kv_cache, [p], scale, out)
                continue
            keys, values = prefill_keys_values(p, k, v, kv_cache)
            self._prefill(
                q[p.q_start : p.q_end],
                keys,
                values,
                p.seq_len - (p.q_end - p.q_start),
                scale,
                out[p.q_start : p.q_end],
            )

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
