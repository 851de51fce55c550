"""Telemetry scenarios for the console tests, built by a real engine core (no model).

A ``FakeRunner`` stands in for the model, so the snapshots carry real block tables,
refcounts, prefix-cache state, preemptions and events. Times are then pinned so that
rendered screens are byte-for-byte stable.
"""

from __future__ import annotations

import numpy as np
from fakes import FakeRunner

from pagectl.engine.commands import SetConfig
from pagectl.engine.config import CacheConfig, SchedulerConfig
from pagectl.engine.core import EngineCore
from pagectl.engine.sampling_params import SamplingParams
from pagectl.engine.scheduler import Scheduler
from pagectl.engine.telemetry import (
    TELEMETRY_VERSION,
    BlockMap,
    Counters,
    Event,
    ModelInfo,
    RequestRow,
    StepStat,
    TelemetrySnapshot,
    decode_snapshot,
    encode_snapshot,
)

# The fixed "now" of every scenario (and of the console's clock in tests).
NOW = 1_750_000_000.0
UPTIME = 3725.0
BLOCK_SIZE = 16
SYSTEM_PROMPT = list(range(100, 164))  # 64 tokens = 4 full blocks
MODEL = ModelInfo(
    model="tiny-qwen3",
    dtype="float32",
    device="cpu",
    tp_size=1,
    kv_bytes_per_block=4096,
    kv_bytes_per_rank=4096 * 96,
    max_model_len=1024,
)


def make_core(num_blocks: int = 96, budget: int = 256, max_seqs: int = 16) -> EngineCore:
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            max_model_len=1024,
            long_prefill_token_threshold=0,
            policy="fcfs",
        ),
        CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=num_blocks, enable_prefix_caching=True),
    )
    info = ModelInfo(
        MODEL.model,
        MODEL.dtype,
        MODEL.device,
        MODEL.tp_size,
        MODEL.kv_bytes_per_block,
        MODEL.kv_bytes_per_block * num_blocks,
        MODEL.max_model_len,
    )
    return EngineCore(sched, FakeRunner(), vocab_size=2000, eos_token_ids=[3], model_info=info)


class Recorder:
    """Steps a core and takes pinned-time snapshots, one per simulated second."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.snapshots: list[TelemetrySnapshot] = []
        self._event_times: dict[int, float] = {}
        self._arrivals: dict[str, int] = {}

    def add(self, request_id: str, prompt: list[int], **sp) -> None:
        self.core.add_request(request_id, prompt, SamplingParams(ignore_eos=True, **sp))
        self._arrivals[request_id] = len(self.snapshots)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.core.step()
        self.take()

    def take(self) -> TelemetrySnapshot:
        # Through the wire format: the core hands out live objects (counters) by reference.
        snap = decode_snapshot(encode_snapshot(self.core.snapshot()))
        k = len(self.snapshots)
        snap.time = float(k)  # re-based below, once the count is known
        for ev in snap.events:
            self._event_times.setdefault(ev.event_id, float(k))
        for r in snap.requests:
            r.age_s = float(k - self._arrivals.get(r.request_id, 0)) + 0.4
        self.snapshots.append(snap)
        return snap

    def pinned(self) -> list[TelemetrySnapshot]:
        """The snapshots with engine times ending at ``NOW``, one second apart."""
        last = len(self.snapshots) - 1
        for snap in self.snapshots:
            k = snap.time
            snap.time = NOW - (last - k)
            snap.start_time = NOW - UPTIME
            for ev in snap.events:
                ev.time = NOW - (last - self._event_times[ev.event_id])
            steps = snap.steps
            for i, s in enumerate(steps):
                s.time = snap.time - 0.01 * (len(steps) - i)
                s.duration_s = 0.004
        return self.snapshots


def busy_snapshots() -> list[TelemetrySnapshot]:
    """A busy engine: shared system prompts, n=3 sampling, cached blocks, a preemption."""
    rec = Recorder(make_core(num_blocks=72))
    rec.take()
    for i in range(3):
        rec.add(f"chat-{i}", SYSTEM_PROMPT + [200 + i] * (10 + 5 * i), max_tokens=6)
    rec.run(4)
    rec.run(4)  # the chats finish: their prompt blocks stay cached
    rec.add("chat-3", SYSTEM_PROMPT + [300] * 21, max_tokens=120)
    rec.add("sample", SYSTEM_PROMPT + [301] * 9, max_tokens=120, n=3)
    rec.run(3)
    rec.core.apply_command(SetConfig("max_num_batched_tokens", 192), client="ctl@ops:4242")
    for i in range(3):
        rec.add(f"doc-{i}", [400 + i] * 260, max_tokens=120)
    for _ in range(9):
        rec.run(4)  # the pool runs dry around the 8th: doc-2 is preempted
    return rec.pinned()


def idle_snapshots() -> list[TelemetrySnapshot]:
    """Nothing running; earlier requests left cached prefixes behind."""
    rec = Recorder(make_core(num_blocks=96))
    rec.take()
    for i in range(4):
        rec.add(f"warmup-{i}", SYSTEM_PROMPT + [500 + i] * 20, max_tokens=4)
    rec.run(8)
    rec.run(1)
    rec.run(1)
    return rec.pinned()


def huge_snapshot(num_blocks: int = 1_000_000, seed: int = 0, seq: int = 1) -> TelemetrySnapshot:
    """A large pool built directly: in-use, shared, cached and free regions, 200 sequences."""
    rng = np.random.default_rng(seed)
    ref = np.zeros(num_blocks, dtype=np.uint8)
    hashed = np.zeros(num_blocks, dtype=np.uint8)
    # Cached prefixes in the first fifth, live sequences after, then a free tail.
    cached_end = num_blocks // 5
    hashed[:cached_end] = rng.random(cached_end) < 0.7
    rows = []
    shared_prefix = np.arange(cached_end, cached_end + 64, dtype=np.uint32)
    ref[shared_prefix] = 0
    pos = cached_end + 64
    live_end = int(num_blocks * 0.85)
    n_req = 200
    per_req = (live_end - pos) // n_req
    for i in range(n_req):
        own = np.arange(pos, pos + per_req - 1, dtype=np.uint32)
        pos += per_req
        table = np.concatenate([shared_prefix[: 8 + i % 56], own])
        ref[table] += 1
        hashed[table[:-1]] = 1
        computed = len(table) * BLOCK_SIZE - (i % BLOCK_SIZE)
        rows.append(
            RequestRow(
                f"req-{i:03d}",
                0,
                "running" if i < 180 else "waiting",
                i % 3,
                computed - 40,
                40,
                computed,
                128,
                len(table),
                8 + i % 56,
                int(i % 4 == 0),
                float(i),
                table.astype("<u4").tobytes(),
            )
        )
    for r in rows[180:]:
        r.num_blocks = r.num_shared_blocks = r.num_computed_tokens = 0
        r.num_cached_tokens = 0
        r.admitted = False
        r.block_ids = b""
    ref[shared_prefix] = np.minimum(ref[shared_prefix], 255)
    used = int((ref > 0).sum())
    cached = int(((ref == 0) & (hashed == 1)).sum())
    counters = Counters(
        prefix_queries=9_000_000,
        prefix_hits=4_100_000,
        preemptions=37,
        preemptions_by_reason={"kv_blocks": 37},
        prompt_tokens=50_000_000,
        generation_tokens=12_000_000,
        steps=400_000,
        finished_by_reason={"stop": 9000},
        evictions=120,
    )
    steps = [
        StepStat(400_000 - 63 + i, NOW - 0.01 * (64 - i), 0.03, 7000 + 13 * i, 8192, 180, 6800, 180)
        for i in range(64)
    ]
    events = [
        Event(
            1,
            NOW - 30,
            "preemption",
            "preempted req-199 (kv_blocks): 4,000 tokens to recompute",
            {"victim": "req-199", "reason": "kv_blocks", "tokens_lost": 4000},
        ),
    ]
    config = {
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 256,
        "long_prefill_token_threshold": 0,
        "enable_prefix_caching": True,
        "paused": False,
        "policy": "fcfs",
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": num_blocks,
        "max_model_len": 32768,
        "max_num_seqs_limit": 256,
        "max_num_batched_tokens_limit": 32768,
    }
    return TelemetrySnapshot(
        version=TELEMETRY_VERSION,
        seq=seq,
        time=NOW,
        start_time=NOW - UPTIME,
        engine_state="running",
        model=ModelInfo("Qwen3-32B", "bfloat16", "cuda", 2, 262_144, 262_144 * num_blocks, 32768),
        config=config,
        blocks=BlockMap(num_blocks, BLOCK_SIZE, ref.tobytes(), hashed.tobytes()),
        num_free_blocks=num_blocks - used,
        num_cached_free_blocks=cached,
        num_used_blocks=used,
        num_used_token_slots=used * BLOCK_SIZE - 180 * 7,
        num_running=180,
        num_waiting=20,
        requests=rows,
        counters=counters,
        steps=steps,
        events=events,
    )


# -- the scenarios themselves must show what the screens claim -----------------------------


def test_busy_scenario_has_sharing_cache_partials_and_a_preemption():
    snaps = busy_snapshots()
    last = snaps[-1]
    ref = np.frombuffer(last.blocks.ref_counts, np.uint8)
    hashed = np.frombuffer(last.blocks.hashed, np.uint8)
    assert (ref > 1).any(), "no shared block"
    assert ((ref == 0) & (hashed == 1)).any(), "no cached block"
    assert last.counters.preemptions >= 1
    assert any(r.index > 0 for r in last.requests), "no forked sample"
    assert {e.kind for e in last.events} >= {"preemption", "config"}
    assert last.counters.prefix_hits > 0
    assert [s.time for s in snaps] == [NOW - k for k in range(len(snaps) - 1, -1, -1)]


def test_idle_scenario_is_idle_with_cached_prefixes():
    last = idle_snapshots()[-1]
    assert last.num_running == last.num_waiting == 0
    assert last.num_used_blocks == 0
    assert last.num_cached_free_blocks > 0


def test_huge_scenario_is_consistent():
    snap = huge_snapshot(100_000)
    ref = np.frombuffer(snap.blocks.ref_counts, np.uint8)
    assert len(ref) == 100_000
    assert snap.num_used_blocks == int((ref > 0).sum())
    assert ref.max() > 100  # the shared prefix is held by many sequences
