"""KV-cache events on the wire, in vLLM's format (``vllm/distributed/kv_events.py``).

Configured by ``--kv-events-config JSON`` with vLLM's ``KVEventsConfig`` fields. Each engine
step that changed the prefix cache becomes one batch, published as a three-frame message on a
PUB socket::

    [topic (utf-8), seq (8-byte big-endian, from 0, +1 per batch), payload (msgpack)]

The payload is ``KVEventBatch`` encoded as a msgpack array ``[ts, [event, ...], dp_rank]``;
each event is an array whose first item is its tag (the class name):

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
     lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

Block hashes are the prefix cache's 32-byte sha256 chain hashes (msgpack bin), as
``ctl inspect-block`` reports them in hex. ``medium`` is ``"GPU"``, the name vLLM gives the
engine's own KV pool whatever the device.

Replay: a ROUTER socket on ``replay_endpoint``. A DEALER or REQ client sends
``[b"", start_seq (8-byte big-endian)]`` and receives ``[b"", seq, payload]`` for every buffered
batch with ``seq >= start_seq`` (the last ``buffer_steps`` batches), then ``[b"", -1 (8-byte
signed big-endian), b""]``.

Invariants: the engine loop only hands a batch to a bounded queue (``put_nowait``); the
publisher's own thread encodes, sends (PUB drops for a slow subscriber at ``hwm``; the
subscriber sees the gap in ``seq`` and replays) and serves replay. A batch that finds the
queue full is dropped and counted (``num_dropped``), never waited for. Sockets bind on
loopback or ipc:// only, unless the daemon is started with ``--kv-events-allow-remote``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import queue
import threading
import time
import urllib.parse
from collections import deque
from typing import Any

import msgspec
import zmq

from pagectl.engine.kv.events import AllCleared, KVEvent, RemovedBlocks, StoredBlocks

log = logging.getLogger("pagectl.kv_events")

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's ``KVEventsConfig`` (same fields, same defaults but the endpoint's host)."""

    # Publish KV-cache events at all.
    enable_kv_cache_events: bool = False
    # "zmq" or "null"; unset: "zmq" when enabled, else "null" (as vLLM).
    publisher: str | None = None
    # PUB endpoint. ipc:// and tcp:// on a loopback host or a wildcard are bound; another
    # tcp:// host is connected to (a subscriber that binds, as llm-d's scheduler does).
    endpoint: str = "tcp://127.0.0.1:5557"
    # ROUTER endpoint for replay requests (bound); None: no replay.
    replay_endpoint: str | None = None
    # Batches kept for replay.
    buffer_steps: int = 10_000
    # PUB send high-water mark (messages queued per subscriber before it drops).
    hwm: int = 100_000
    # Batches waiting for the publisher thread before new ones are dropped.
    max_queue_size: int = 100_000
    # First frame of every message; subscribers filter on its prefix.
    topic: str = ""

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


# -- vLLM's event layouts (array-like msgspec structs, tag = class name) -----------------


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three events."""


class BlockStored(KVCacheEvent):
    # Chain hashes of the stored blocks, in order.
    block_hashes: list[bytes]
    # Hash of the block before the first one; None for a sequence's first block.
    parent_block_hash: bytes | None
    # The blocks' tokens, concatenated.
    token_ids: list[int]
    # Tokens per block.
    block_size: int
    # LoRA adapter id (pagectl serves no adapters: None).
    lora_id: int | None
    # Where the blocks live ("GPU": the engine's KV pool).
    medium: str | None
    # LoRA adapter name (None).
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    # Hashes of blocks no longer in the prefix cache.
    block_hashes: list[bytes]
    # As in BlockStored.
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    # Wall-clock time (seconds since the epoch) when the step's events were taken.
    ts: float
    # The step's events, in the order the pool made them.
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    # This engine's data-parallel rank.
    data_parallel_rank: int | None = None


def parse_kv_events_config(text: str, *, allow_remote: bool = False) -> KVEventsConfig:
    """``--kv-events-config`` JSON -> config; ValueError naming what is wrong."""
    try:
        cfg = msgspec.json.decode(text, type=KVEventsConfig)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"--kv-events-config: {e}") from None
    if cfg.publisher not in (None, "zmq", "null"):
        raise ValueError(f"--kv-events-config: unknown publisher {cfg.publisher!r} (zmq, null)")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--kv-events-config: {name} must be >= 1")
    if cfg.active:
        check_endpoint(cfg.endpoint, allow_remote)
        if cfg.replay_endpoint is not None:
            check_endpoint(cfg.replay_endpoint, allow_remote)
    return cfg


def _is_wildcard(host: str) -> bool:
    return host in ("*", "", "0.0.0.0", "::")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _host(endpoint: str) -> str:
    rest = endpoint[len("tcp://") :]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    if host.startswith("["):
        host = host[1:-1]
    return host if host == "*" else (urllib.parse.urlsplit(f"//{rest}").hostname or host)


def check_endpoint(endpoint: str, allow_remote: bool) -> None:
    if endpoint.startswith("ipc://"):
        return
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"--kv-events-config: endpoint must be tcp:// or ipc://: {endpoint!r}")
    if not allow_remote and not _is_loopback(_host(endpoint)):
        raise ValueError(
            f"--kv-events-config: {endpoint!r} is not on a loopback address; pass "
            "--kv-events-allow-remote to publish KV events off this host"
        )


def should_bind(endpoint: str) -> bool:
    """Whether the publisher binds ``endpoint`` (ipc://, loopback or wildcard tcp://) rather
    than connecting out to a subscriber that binds."""
    if not endpoint.startswith("tcp://"):
        return True
    host = _host(endpoint)
    return _is_wildcard(host) or _is_loopback(host)


def to_wire(events: list[KVEvent], block_size: int) -> list[Any]:
    out: list[Any] = []
    for ev in events:
        if isinstance(ev, StoredBlocks):
            out.append(
                BlockStored(
                    block_hashes=ev.block_hashes,
                    parent_block_hash=ev.parent_block_hash,
                    token_ids=ev.token_ids,
                    block_size=block_size,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                )
            )
        elif isinstance(ev, RemovedBlocks):
            out.append(BlockRemoved(block_hashes=ev.block_hashes, medium=MEDIUM_GPU))
        elif isinstance(ev, AllCleared):
            out.append(AllBlocksCleared())
    return out


class KVEventPublisher:
    """PUB + replay ROUTER on their own thread (see module docstring)."""

    def __init__(
        self,
        cfg: KVEventsConfig,
        block_size: int,
        *,
        data_parallel_rank: int = 0,
        ctx: zmq.Context | None = None,
    ) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        # Batches dropped because the queue was full (the engine never waits).
        self.num_dropped = 0
        # Batches sent on the PUB socket.
        self.num_published = 0
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | None] = queue.Queue(
            cfg.max_queue_size
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._ctx = ctx or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            if should_bind(cfg.endpoint):
                self._pub.bind(cfg.endpoint)
            else:
                self._pub.connect(cfg.endpoint)
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._topic = cfg.topic.encode("utf-8")
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Hand one step's events over; never blocks (a full queue drops the batch)."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.num_dropped += 1

    def shutdown(self, timeout: float = 1.0) -> None:
        """Stop the thread (what is still queued is not sent) and close the sockets."""
        self._stop.set()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)

    # -- the publisher thread -----------------------------------------------------------

    def _run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        while not self._stop.is_set():
            if self._replay is not None:
                while self._replay.poll(0):
                    try:
                        self._serve_replay()
                    except zmq.ZMQError:
                        log.exception("kv-events replay failed")
                        break
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            batch = KVEventBatch(
                ts=ts,
                events=to_wire(events, self.block_size),
                data_parallel_rank=self.data_parallel_rank,
            )
            payload = enc.encode(batch)
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            try:
                self._pub.send_multipart(
                    [self._topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK
                )
                self.num_published += 1
            except zmq.Again:
                pass  # a subscriber's queue is full: it sees the gap and replays

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # [identity, b"", start_seq] only
        ident, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([ident, b"", END_SEQ, b""])
