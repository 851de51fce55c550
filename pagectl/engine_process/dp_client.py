"""Data parallelism on one node: N engine-core processes behind the one API server.

``DPEngineClient`` is the API server's engine client (``EngineClientProtocol``) over N
``EngineClient``s, each a separate engine process with its own KV cache, scheduler and model
replica (each may itself run tensor parallel). Per request it picks an engine with the
routing policy (``pagectl/routing/policy.py``), fed by:

- load: each engine's running + waiting sequences and KV usage, from the ``EngineStats`` it
  sends at the telemetry rate, and the requests this client routed to it and not released
  (exact, so a burst between two reports still spreads);
- prefix affinity: the request's leading chain block hashes against what each engine
  reported cached in its KV-cache events (vLLM's ``BlockStored`` / ``BlockRemoved`` /
  ``AllBlocksCleared``, followed with replay by ``router/backends.py:Backend``), never
  guessed from past routing.

Invariants:
- ``_owner[rid]`` names the engine holding engine request ``rid`` from ``submit`` until
  ``release`` / ``abort``; aborts, stop strings and releases go to that engine only.
- One engine dying fails only the requests it held (its own ``EngineClient`` fails its
  routes); it is never chosen again. ``dead`` is set only when every engine is dead.
- ``num_unstarted`` is the sum over engines, so ``--max-num-queued-requests`` counts across
  the whole daemon.

Event loop thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import zmq.asyncio

from pagectl.engine.kv.hashing import hash_request_blocks
from pagectl.engine.outputs import EngineRequest
from pagectl.engine_process import wire
from pagectl.engine_process.client import (
    EngineClient,
    EngineDeadError,
    EngineError,
    EngineStartError,
    OutputQueue,
)
from pagectl.routing.policy import RoutingPolicy, TargetLoad

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger("pagectl.dp")

# Leading blocks hashed per request: affinity is decided by the start of the prompt.
MAX_HASHED_BLOCKS = 64


class DPEngineClient:
    """N engines behind one API server (see the module docstring).

    Args:
        engines: one ``EngineClient`` per data-parallel rank, in rank order.
        policy: the routing policy (``--dp-routing``, bounded skew).
        kv_events: per engine, its KV-event (PUB endpoint, replay endpoint or None) to
            follow for prefix affinity, or None (routing by load only for that engine).
    """

    def __init__(
        self,
        engines: list[EngineClient],
        policy: RoutingPolicy,
        kv_events: list[tuple[str, str | None] | None] | None = None,
    ) -> None:
        if len(engines) < 2:
            raise ValueError("DPEngineClient needs at least two engines")
        self.engines = engines
        self.policy = policy
        self.kv_events = kv_events or [None] * len(engines)
        # Engine 0's handshake (every engine serves the same model), once all started.
        self.ready: wire.EngineReady | None = None
        # Why every engine is dead, or None while one lives.
        self.dead: str | None = None
        # Called with (engine index, reason) when one engine dies.
        self.on_engine_dead: list[Callable[[int, str], None]] = []
        # Called with the reason when the last live engine died.
        self.on_dead: list[Callable[[str], None]] = []
        # Routing decisions per engine and reason, for /metrics.
        self.decisions: dict[tuple[int, str], int] = {}
        self._owner: dict[str, int] = {}
        self._block_size = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._followers: list[asyncio.Task] = []
        # Per engine, what follows its KV events (batches applied, gaps, replays), when any.
        self.kv_followers: dict[int, Any] = {}
        for i, e in enumerate(engines):
            e.on_dead.append(functools.partial(self._engine_died, i))

    # -- life cycle ---------------------------------------------------------------------

    async def start(self) -> wire.EngineReady:
        """Start every engine at once; any failure stops them all (``EngineStartError``)."""
        results = await asyncio.gather(*(e.start() for e in self.engines), return_exceptions=True)
        errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if errors:
            i, err = errors[0]
            await asyncio.gather(*(e.shutdown(5.0) for e in self.engines), return_exceptions=True)
            if isinstance(err, EngineStartError):
                raise EngineStartError(f"engine {i}: {err}") from None
            raise err
        readies = [r for r in results if isinstance(r, wire.EngineReady)]
        self.ready = readies[0]
        self._block_size = int(self.ready.config.get("block_size", 0))
        if self.policy.policy == "prefix":
            self._follow_kv_events()
        return self.ready

    def _follow_kv_events(self) -> None:
        from pagectl.router.backends import Backend, BackendSpec

        self._ctx = zmq.asyncio.Context()
        for i, ep in enumerate(self.kv_events):
            if ep is None:
                continue
            follower = Backend(BackendSpec(url=str(i), kv_events=ep[0], replay=ep[1]))
            self.kv_followers[i] = follower
            self._followers.append(
                asyncio.create_task(
                    follower.follow_events(self._ctx, self.policy), name=f"kv-events-{i}"
                )
            )

    async def shutdown(self, timeout: float = 10.0) -> int | None:
        """Stop every engine (in parallel); the worst exit status, or None."""
        for t in self._followers:
            t.cancel()
        for t in self._followers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        rcs = await asyncio.gather(
            *(e.shutdown(timeout) for e in self.engines), return_exceptions=True
        )
        if self._ctx is not None:
            self._ctx.term()
        codes = [rc for rc in rcs if isinstance(rc, int)]
        return max(codes, key=abs) if codes else None

    # -- state ----------------------------------------------------------------------------

    @property
    def num_unstarted(self) -> int:
        return sum(e.num_unstarted for e in self.engines)

    @property
    def stats(self) -> wire.EngineStats | None:
        """Engine 0's latest figures (every engine's: ``engine_stats``)."""
        return self.engines[0].stats

    def engine_stats(self) -> list[wire.EngineStats | None]:
        """Each engine's latest figures, by rank."""
        return [e.stats for e in self.engines]

    @property
    def num_alive(self) -> int:
        return sum(e.dead is None for e in self.engines)

    def _engine_died(self, index: int, reason: str) -> None:
        log.warning("engine %d died: %s", index, reason)
        self.policy.index.forget(str(index))
        for cb in list(self.on_engine_dead):
            cb(index, reason)
        if self.dead is None and self.num_alive == 0:
            self.dead = f"all {len(self.engines)} engines died (last: engine {index}: {reason})"
            for cb2 in list(self.on_dead):
                cb2(self.dead)

    # -- requests -------------------------------------------------------------------------

    def _targets(self) -> list[TargetLoad]:
        out = []
        for i, e in enumerate(self.engines):
            s = e.stats
            out.append(
                TargetLoad(
                    str(i),
                    num_requests=s.num_running + s.num_waiting if s else 0,
                    inflight=len(e._routes),
                    kv_usage=s.num_used_blocks / s.num_blocks if s and s.num_blocks else 0.0,
                    alive=e.dead is None,
                )
            )
        return out

    def choose(self, request: EngineRequest) -> int:
        """The engine for ``request`` (the policy's choice among live engines)."""
        hashes: list[bytes] = []
        if self.policy.policy == "prefix" and self._block_size:
            hash_request_blocks(
                request.prompt_token_ids,
                self._block_size,
                hashes,
                request.cache_salt,
                MAX_HASHED_BLOCKS,
            )
        d = self.policy.choose(self._targets(), hashes)
        if d is None:
            raise EngineDeadError(self.dead or "no engine is alive")
        key = (d.index, d.reason)
        self.decisions[key] = self.decisions.get(key, 0) + 1
        return d.index

    def submit(self, request: EngineRequest, queue: OutputQueue) -> None:
        i = self.choose(request)
        self.engines[i].submit(request, queue)  # raises before any route is kept
        self._owner[request.request_id] = i

    def _by_engine(self, request_ids: list[str], pop: bool) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for rid in request_ids:
            i = self._owner.pop(rid, None) if pop else self._owner.get(rid)
            if i is not None:
                groups.setdefault(i, []).append(rid)
        return groups

    def abort(self, request_ids: list[str]) -> None:
        for i, ids in self._by_engine(request_ids, pop=True).items():
            self.engines[i].abort(ids)

    def release(self, request_ids: list[str]) -> None:
        for i, ids in self._by_engine(request_ids, pop=True).items():
            self.engines[i].release(ids)

    def abort_all(self) -> None:
        for e in self.engines:
            e.abort_all()

    def fail_all(self, err: EngineError) -> None:
        for e in self.engines:
            e.fail_all(err)

    def finish_stop_string(self, request_id: str, index: int, stop: str) -> None:
        i = self._owner.get(request_id)
        if i is not None:
            self.engines[i].finish_stop_string(request_id, index, stop)

    def set_draining(self, draining: bool = True) -> None:
        for e in self.engines:
            e.set_draining(draining)

    def engine_of(self, request_id: str) -> int | None:
        """The engine holding ``request_id`` (None: not routed, or released)."""
        return self._owner.get(request_id)


class DPCollector:
    """The dispatcher's own series on /metrics: routing decisions by engine and reason, and
    whether each engine is alive."""

    def __init__(self, client: DPEngineClient) -> None:
        self.client = client

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = self.client
        decisions = CounterMetricFamily(
            "pagectl:dp_routing_decisions",
            "Requests sent to each data-parallel engine, by reason (prefix, load, "
            "round_robin, skew: a prefix choice refused by the skew bound).",
            labels=["engine", "reason"],
        )
        for (i, reason), n in sorted(c.decisions.items()):
            decisions.add_metric([str(i), reason], n)
        yield decisions
        alive = GaugeMetricFamily(
            "pagectl:dp_engine_alive",
            "1 while the engine process serves, 0 once dead.",
            labels=["engine"],
        )
        for i, e in enumerate(c.engines):
            alive.add_metric([str(i)], 1.0 if e.dead is None else 0.0)
        yield alive
        batches = CounterMetricFamily(
            "pagectl:dp_kv_event_batches",
            "KV-event batches of each engine the dispatcher applied to its prefix index.",
            labels=["engine"],
        )
        gaps = CounterMetricFamily(
            "pagectl:dp_kv_event_gaps",
            "Gaps in an engine's KV-event sequence numbers the dispatcher saw (filled by "
            "replay, or the engine's index rebuilt).",
            labels=["engine"],
        )
        for i, f in sorted(c.kv_followers.items()):
            batches.add_metric([str(i)], f.num_event_batches)
            gaps.add_metric([str(i)], f.num_event_gaps)
        yield batches
        yield gaps
