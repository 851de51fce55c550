"""The tensor-parallel group a model's layers are sharded over.

Layers take a ``TPGroup`` and shard their weights by ``rank`` out of ``size``. With
``size == 1`` (the default, and all this process does today) every collective is a no-op, so
the single-device path pays nothing for being TP-aware. Multi-rank runs pass a group built on
an initialised ``torch.distributed`` process group.
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

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` (rank order). Identity at size 1."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = TPGroup()


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, or a clear error naming ``what`` when it does not divide."""
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})"
        )
    return numerator // denominator
