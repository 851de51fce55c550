"""The tensor-parallel group a model's layers are sharded over.

Layers take a ``TPGroup`` and shard their weights by ``rank`` out of ``size``. With
``size == 1`` (the default) every collective is a no-op, so the single-device path pays
nothing for being TP-aware. Multi-rank runs pass a group built on an initialised
``torch.distributed`` process group (``pagectl/engine/distributed``).

Every rank must call the same collectives in the same order: the runner guarantees it by
running the same forward on every rank from the same broadcast batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TPGroup:
    """Rank and size of this process in its tensor-parallel group, plus the collectives."""

    rank: int = 0
    size: int = 1
    # torch.distributed process group (None: the default group, or no group when size == 1).
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid tensor-parallel rank {self.rank} of size {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place. Identity at size 1."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum of ``x`` over the group, in place. Identity at size 1."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's ``x`` concatenated along ``dim`` on rank 0 (rank order); None on the
        other ranks. Identity at size 1. Every rank's ``x`` must have the same shape."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        if self.rank != 0:
            dist.gather(x, None, dst=0, group=self.group)
            return None
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = TPGroup()


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, or a clear error naming ``what`` when it does not divide."""
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})"
        )
    return numerator // denominator


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: ``num_kv_heads / tp``, or 1 (replicated) when there are fewer
    KV heads than ranks. Raises ``ValueError`` naming the numbers when neither divides."""
    if num_kv_heads >= tp_size:
        return divide(num_kv_heads, tp_size, "num_key_value_heads")
    if tp_size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) neither divides nor is a multiple "
            f"of the tensor-parallel size ({tp_size})"
        )
    return 1


def check_tp_split(
    num_attention_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int
) -> None:
    """Fail early (before any process or weight exists) when a model cannot be split over
    ``tp_size`` ranks; the same rules the layers apply, with the same messages."""
    divide(num_attention_heads, tp_size, "num_attention_heads")
    kv_heads_per_rank(num_kv_heads, tp_size)
    divide(intermediate_size, tp_size, "intermediate_size")
