"""One backend daemon as the router sees it: health and load from ``/health`` and
``/metrics`` (polled), cached blocks from its KV-event stream (``--kv-events-config``).

Invariants:
- ``load.alive`` is False until the first health check answers 200, after a failed check,
  and after the proxy failed to connect; a later 200 makes it alive again.
- The prefix index holds this backend's blocks only while its event stream is followed
  without a gap: a gap is filled by replay when the backend has a replay endpoint, else (or
  when replay cannot fill it) the index forgets this backend and rebuilds from new events.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from pagectl.routing.policy import RoutingPolicy, TargetLoad

log = logging.getLogger("pagectl.router")

END_SEQ = -1


@dataclass
class BackendSpec:
    # Base URL of the daemon's HTTP API.
    url: str
    # Its KV-event PUB endpoint (None: route by load only for this backend).
    kv_events: str | None = None
    # Its KV-event replay endpoint.
    replay: str | None = None
    # Topic prefix to subscribe to.
    topic: str = ""


def parse_backend(text: str) -> BackendSpec:
    """``URL[,kv_events=ENDPOINT][,replay=ENDPOINT][,topic=T]``."""
    url, *opts = text.split(",")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--backend {text!r}: the first item must be an http(s):// URL")
    spec = BackendSpec(url.rstrip("/"))
    for o in opts:
        k, sep, v = o.partition("=")
        if not sep or k not in ("kv_events", "replay", "topic"):
            raise ValueError(f"--backend {text!r}: unknown option {o!r} (kv_events, replay, topic)")
        setattr(spec, k, v)
    return spec


# -- the events, decoded with vLLM's layout (see docs/KV_EVENTS.md) -----------------------


class _Event(msgspec.Struct, array_like=True, tag=True):
    pass


class _Stored(_Event, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _Removed(_Event, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None = None


class _Cleared(_Event, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(_Batch)

_METRIC = re.compile(r"^(pagectl:[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", re.M)
_BLOCK_SIZE = re.compile(r'pagectl:cache_config_info\{[^}]*block_size="(\d+)"')


@dataclass
class Backend:
    spec: BackendSpec
    load: TargetLoad = field(init=False)
    # Tokens per KV block, from its /metrics (None until the first scrape).
    block_size: int | None = None
    # KV-event batches applied, gaps seen, gaps replay filled.
    num_event_batches: int = 0
    num_event_gaps: int = 0
    num_replayed: int = 0
    _next_seq: int | None = None

    def __post_init__(self) -> None:
        self.load = TargetLoad(self.spec.url, alive=False)

    @property
    def name(self) -> str:
        return self.spec.url

    # -- health and load ------------------------------------------------------------------

    async def poll(self, session: aiohttp.ClientSession, timeout: float) -> None:
        t = aiohttp.ClientTimeout(total=timeout)
        try:
            async with session.get(self.spec.url + "/health", timeout=t) as r:
                ok = r.status == 200
            async with session.get(self.spec.url + "/metrics", timeout=t) as r:
                text = await r.text() if r.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            ok, text = False, ""
        if ok != self.load.alive:
            log.info("backend %s is %s", self.name, "up" if ok else "down")
        self.load.alive = ok
        if text:
            self._read_metrics(text)

    def _read_metrics(self, text: str) -> None:
        values: dict[str, float] = {}
        for name, _labels, value in _METRIC.findall(text):
            values[name] = values.get(name, 0.0) + float(value)
        self.load.num_requests = int(
            values.get("pagectl:num_requests_running", 0)
            + values.get("pagectl:num_requests_waiting", 0)
        )
        self.load.kv_usage = values.get("pagectl:kv_cache_usage_perc", 0.0)
        m = _BLOCK_SIZE.search(text)
        if m:
            self.block_size = int(m.group(1))

    def mark_down(self) -> None:
        self.load.alive = False

    def describe(self) -> dict:
        """This backend in ``GET /router/backends``."""
        return {
            "url": self.spec.url,
            "alive": self.load.alive,
            # Running + waiting as it reported them, and requests the router has in flight.
            "num_requests": self.load.num_requests,
            "inflight": self.load.inflight,
            "kv_usage": self.load.kv_usage,
            "block_size": self.block_size,
            "kv_events": self.spec.kv_events,
            "kv_event_batches": self.num_event_batches,
            "kv_event_gaps": self.num_event_gaps,
        }

    # -- KV events ------------------------------------------------------------------------

    async def follow_events(self, ctx: zmq.asyncio.Context, policy: RoutingPolicy) -> None:
        """Subscribe to the backend's KV events and keep ``policy.index`` in step (runs
        until cancelled)."""
        if self.spec.kv_events is None:
            return
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.spec.topic.encode())
        sub.connect(self.spec.kv_events)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                seq = int.from_bytes(frames[1], "big")
                if self._next_seq is not None and seq > self._next_seq:
                    self.num_event_gaps += 1
                    await self._fill_gap(ctx, policy, self._next_seq, seq)
                if self._next_seq is None or seq >= self._next_seq:
                    self._apply(policy, frames[2])
                    self._next_seq = seq + 1
        finally:
            sub.close(0)

    async def _fill_gap(
        self, ctx: zmq.asyncio.Context, policy: RoutingPolicy, start: int, stop: int
    ) -> None:
        got: list[tuple[int, bytes]] = []
        if self.spec.replay is not None:
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(self.spec.replay)
            try:
                await d.send_multipart([b"", start.to_bytes(8, "big")])
                while True:
                    frames = await asyncio.wait_for(d.recv_multipart(), 2.0)
                    n = int.from_bytes(frames[1], "big", signed=True)
                    if n == END_SEQ:
                        break
                    if n < stop:
                        got.append((n, frames[2]))
            except (asyncio.TimeoutError, IndexError, zmq.ZMQError):
                got = []
            finally:
                d.close(0)
        if [n for n, _ in got] == list(range(start, stop)):
            for _, payload in got:
                self._apply(policy, payload)
            self.num_replayed += 1
        else:
            log.warning("backend %s: KV events %d..%d lost; index rebuilt", self.name, start, stop)
            policy.index.cleared(self.name)

    def _apply(self, policy: RoutingPolicy, payload: bytes) -> None:
        try:
            batch = _DECODER.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            policy.index.cleared(self.name)  # cannot follow: forget rather than guess
            return
        self.num_event_batches += 1
        index = policy.index
        for ev in batch.events:
            if isinstance(ev, _Stored):
                index.stored(self.name, [_as_bytes(h) for h in ev.block_hashes])
            elif isinstance(ev, _Removed):
                index.removed(self.name, [_as_bytes(h) for h in ev.block_hashes])
            else:
                index.cleared(self.name)


def _as_bytes(h: bytes | int) -> bytes:
    return h if isinstance(h, bytes) else h.to_bytes(32, "big", signed=h < 0)


async def poll_forever(
    backends: list[Backend],
    session: aiohttp.ClientSession,
    interval: float,
    timeout: float | None = None,
) -> None:
    """Health-check every backend each ``interval`` s, each check within ``timeout`` s
    (None: the interval, at least 1 s)."""
    limit = timeout or max(interval, 1.0)
    while True:
        await asyncio.gather(*(b.poll(session, limit) for b in backends))
        await asyncio.sleep(interval)
