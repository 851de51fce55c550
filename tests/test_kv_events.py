"""KV-cache events: the block pool's transitions, vLLM's wire format, sequence numbers and
replay, and a real daemon publishing them (``--kv-events-config``)."""

from __future__ import annotations

import json
import queue
import time
import urllib.request

import msgspec
import pytest
import zmq

from pagectl.engine.kv.block_pool import BlockPool
from pagectl.engine.kv.events import AllCleared, KVEventRecorder, RemovedBlocks, StoredBlocks
from pagectl.engine_process.kv_events import (
    KVEventPublisher,
    KVEventsConfig,
    parse_kv_events_config,
)
from pagectl.testing.daemon_process import DaemonProcess, free_port

# -- a decoder written from vLLM's published layout (vllm/distributed/kv_events.py) ---------
# EventBatch(array_like): ts, events, data_parallel_rank. KVCacheEvent(array_like, tag=True):
# the class name first. BlockStored: block_hashes, parent_block_hash, token_ids, block_size,
# lora_id, medium, lora_name. BlockRemoved: block_hashes, medium. AllBlocksCleared: nothing.


class VEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class VBlockRemoved(VEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class VAllBlocksCleared(VEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]
    data_parallel_rank: int | None = None


VDEC = msgspec.msgpack.Decoder(VKVEventBatch)


def h(i: int) -> bytes:
    return bytes([i]) * 32


# -- the pool's transitions -------------------------------------------------------------


def test_pool_records_stored_removed_cleared_and_merges_chains():
    pool = BlockPool(4, 2)
    rec = pool.events = KVEventRecorder()
    a, b, c = pool.get_new_blocks(3)
    assert pool.cache_block(a, h(1), (1, 2), None)
    assert pool.cache_block(b, h(2), (3, 4), h(1))  # continues the chain: merged
    assert not pool.cache_block(c, h(2), (3, 4), h(1))  # content already cached: no event
    assert pool.cache_block(c, h(9), (5, 6), h(7))  # another chain: its own event
    evs = rec.take()
    assert [type(e) for e in evs] == [StoredBlocks, StoredBlocks]
    assert evs[0].block_hashes == [h(1), h(2)] and evs[0].parent_block_hash is None
    assert evs[0].token_ids == [1, 2, 3, 4]
    assert evs[1].block_hashes == [h(9)] and evs[1].parent_block_hash == h(7)
    assert rec.take() == []
    pool.free_blocks([c, b, a])
    pool.get_new_blocks(4)  # the free block first, then the three cached ones: evicted
    (removed,) = rec.take()
    assert isinstance(removed, RemovedBlocks)
    assert sorted(removed.block_hashes) == sorted([h(1), h(2), h(9)])
    pool.reset_prefix_cache()
    assert [type(e) for e in rec.take()] == [AllCleared]


def test_pool_without_recorder_records_nothing():
    pool = BlockPool(2, 2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, h(1), (1, 2))
    assert pool.events is None


# -- the publisher: format, sequence numbers, replay, drops ------------------------------


def _sub(ctx: zmq.Context, endpoint: str, topic: bytes = b"") -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, topic)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(endpoint)
    return s


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.RCVTIMEO, 5000)
    d.connect(endpoint)
    d.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        empty, seq, payload = d.recv_multipart()
        assert empty == b""
        n = int.from_bytes(seq, "big", signed=True)
        if n == -1:
            break
        out.append((n, payload))
    d.close(0)
    return out


def test_publisher_frames_decode_with_vllm_layout_and_replay(tmp_path):
    ctx = zmq.Context.instance()
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        topic="kv@test",
    )
    pub = KVEventPublisher(cfg, block_size=2, data_parallel_rank=3)
    sub = _sub(ctx, cfg.endpoint, b"kv@")
    try:
        time.sleep(0.2)  # PUB/SUB join
        pub.publish([StoredBlocks(h(1), None, (1, 2))])
        pub.publish([])  # nothing: no batch, no sequence number
        pub.publish([RemovedBlocks(h(1)), AllCleared()])
        frames = [sub.recv_multipart() for _ in range(2)]
        assert [f[0] for f in frames] == [b"kv@test"] * 2
        assert [int.from_bytes(f[1], "big") for f in frames] == [0, 1]
        b0, b1 = (VDEC.decode(f[2]) for f in frames)
        assert b0.data_parallel_rank == 3 and b0.ts > 1e9
        (st,) = b0.events
        assert isinstance(st, VBlockStored)
        assert st.block_hashes == [h(1)] and st.parent_block_hash is None
        assert st.token_ids == [1, 2] and st.block_size == 2
        assert st.lora_id is None and st.medium == "GPU" and st.lora_name is None
        assert isinstance(b1.events[0], VBlockRemoved) and b1.events[0].block_hashes == [h(1)]
        assert isinstance(b1.events[1], VAllBlocksCleared)
        # The raw layout, item by item, as vLLM's array-like structs put it.
        raw = msgspec.msgpack.decode(frames[0][2])
        assert raw[1][0][:2] == ["BlockStored", [h(1)]] and raw[2] == 3
        # Replay of a missed range: from seq 1, the same payloads, then the end marker.
        assert _replay(ctx, cfg.replay_endpoint, 1) == [(1, frames[1][2])]
        assert [s for s, _ in _replay(ctx, cfg.replay_endpoint, 0)] == [0, 1]
    finally:
        sub.close(0)
        pub.shutdown()


def test_publisher_drops_and_counts_when_its_queue_is_full(tmp_path):
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/p")
    pub = KVEventPublisher(cfg, block_size=2)
    try:
        full: queue.Queue = queue.Queue(1)
        full.put_nowait((0.0, []))
        real, pub._queue = pub._queue, full  # a stalled publisher thread
        t0 = time.perf_counter()
        for _ in range(100):
            pub.publish([AllCleared()])
        assert time.perf_counter() - t0 < 0.05  # never waits
        assert pub.num_dropped == 100
        pub._queue = real
    finally:
        pub.shutdown()


def test_config_is_vllms_and_loopback_only():
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert cfg.active and cfg.endpoint == "tcp://127.0.0.1:5557" and cfg.buffer_steps == 10_000
    assert not parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "null"}'
    ).active
    with pytest.raises(ValueError, match="bogus"):
        parse_kv_events_config('{"bogus": 1}')
    with pytest.raises(ValueError, match="loopback"):
        parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}')
    with pytest.raises(ValueError, match="loopback"):
        parse_kv_events_config(
            '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://10.0.0.1:5558"}'
        )
    ok = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}', allow_remote=True
    )
    assert ok.endpoint == "tcp://*:5557"


# -- a daemon publishing ------------------------------------------------------------------

BS = 16


@pytest.fixture(scope="module")
def kv_daemon(tmp_path_factory, tok_dir):
    pub_port, replay_port = free_port(), free_port()
    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{pub_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": "kv-events",
    }
    d = DaemonProcess(
        tmp_path_factory.mktemp("rt"),
        [
            "--model",
            str(tok_dir),
            "--engine-factory",
            "pagectl.testing.fake_engine:fake_engine",
            "--num-kv-blocks",
            "12",
            "--block-size",
            str(BS),
            "--max-model-len",
            "160",
            "--kv-events-config",
            json.dumps(cfg),
        ],
    )
    d.start()
    yield d, cfg
    d.kill()


def _complete(d: DaemonProcess, prompt: list[int], max_tokens: int = 1) -> dict:
    body = json.dumps({"model": d.info.model, "prompt": prompt, "max_tokens": max_tokens})
    req = urllib.request.Request(
        d.base_url + "/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _recv_until(sub: zmq.Socket, frames: list, pred) -> list:
    while True:
        f = sub.recv_multipart()
        frames.append(f)
        batch = VDEC.decode(f[2])
        if any(pred(e) for e in batch.events):
            return frames


@pytest.mark.slow
def test_daemon_publishes_stored_removed_cleared_with_replay(kv_daemon):
    from pagectl.control.client import AdminClient
    from pagectl.engine.commands import InspectBlock

    d, cfg = kv_daemon
    ctx = zmq.Context.instance()
    sub = _sub(ctx, cfg["endpoint"], b"kv-events")
    admin = AdminClient.from_runtime(d.info)
    try:
        time.sleep(0.3)
        prompt = [5 + (i * 7) % 200 for i in range(3 * BS + 5)]  # 3 full blocks
        _complete(d, prompt)
        frames: list = []
        _recv_until(sub, frames, lambda e: isinstance(e, VBlockStored))
        stored = [
            e for f in frames for e in VDEC.decode(f[2]).events if isinstance(e, VBlockStored)
        ]
        hashes = [x for e in stored for x in e.block_hashes]
        assert len(hashes) >= 3
        assert stored[0].parent_block_hash is None and stored[0].block_size == BS
        assert [x for e in stored for x in e.token_ids][: 3 * BS] == prompt[: 3 * BS]
        # The same hashes the admin channel reports for the cached blocks.
        inspected = {admin.command(InspectBlock(i))["hash"] for i in range(12)} - {None}
        assert {x.hex() for x in hashes[:3]} <= inspected

        # Other prompts take the whole pool: the first prompt's blocks are evicted.
        other = [[200 + j + (i * 3) % 50 for i in range(4 * BS + 1)] for j in range(3)]
        for p in other:
            _complete(d, p)
        _recv_until(
            sub,
            frames,
            lambda e: isinstance(e, VBlockRemoved) and hashes[0] in e.block_hashes,
        )

        r = d.ctl("reset-prefix-cache")
        assert r.returncode == 0, r.stderr
        _recv_until(sub, frames, lambda e: isinstance(e, VAllBlocksCleared))

        seqs = [int.from_bytes(f[1], "big") for f in frames]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gaps
        # A subscriber that missed everything after the first batch replays it.
        replayed = _replay(ctx, cfg["replay_endpoint"], seqs[1])
        assert replayed[: len(frames) - 1] == [(s, f[2]) for s, f in zip(seqs[1:], frames[1:])]
        with urllib.request.urlopen(d.base_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert 'pagectl:kv_events_dropped_total{engine="0"} 0.0' in text
    finally:
        sub.close(0)
