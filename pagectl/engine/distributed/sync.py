"""Start-up agreement between the ranks of an engine, through the rendezvous store.

Building an engine on N ranks has points where every rank must be ready before any goes on
(weights loaded; KV pool sized; runner ready). They are store barriers, not collectives: a
rank that is slow to load keeps the others waiting in ``store.wait`` (which fails when rank 0
goes away), and rank 0 polls, so that it notices a dead or failed worker at once instead of
waiting in a collective for a rank that will never come.

``RankSync`` is what the builder needs; ``NO_SYNC`` serves a single rank, ``WorkerSync`` the
ranks 1..N-1, and ``TPWorkers`` rank 0 (``workers.py``).
"""

from __future__ import annotations

import datetime
from typing import Any, Protocol

from pagectl.engine.distributed.rendezvous import stage_key


class RankSync(Protocol):
    def barrier(self, stage: str) -> None:
        """Return once every rank has reached ``stage``."""

    def agree_min(self, name: str, value: int) -> int:
        """The smallest ``value`` any rank offers under ``name``."""


class _NoSync:
    def barrier(self, stage: str) -> None:
        pass

    def agree_min(self, name: str, value: int) -> int:
        return value


NO_SYNC: RankSync = _NoSync()


class WorkerSync:
    """A worker rank's side: publish its own key, then wait for every rank's."""

    def __init__(self, store: Any, rank: int, world_size: int, epoch: int, timeout_s: float):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.epoch = epoch
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def _keys(self, stage: str) -> list[str]:
        return [stage_key(self.epoch, stage, r) for r in range(self.world_size)]

    def barrier(self, stage: str) -> None:
        self.store.set(stage_key(self.epoch, stage, self.rank), b"1")
        self.store.wait(self._keys(stage), self.timeout)

    def agree_min(self, name: str, value: int) -> int:
        self.store.set(stage_key(self.epoch, name, self.rank), str(int(value)).encode())
        keys = self._keys(name)
        self.store.wait(keys, self.timeout)
        return min(int(self.store.get(k)) for k in keys)
