"""The telemetry snapshot and the status map rendered from it."""

from __future__ import annotations

import random

from pagectl.engine.sampling_params import SamplingParams
from pagectl.engine.status import status_view
from tests.test_scheduler import make_core


def _reference(core) -> tuple[int, dict[str, int]]:
    """Used token slots and shared blocks per sequence, computed block by block."""
    pool = core.scheduler.kv.pool
    bs = pool.block_size
    empty: dict[int, int] = {}
    for r in core.scheduler.running:
        if r.block_ids:
            filled = r.num_computed_tokens - (len(r.block_ids) - 1) * bs
            if filled < bs:
                gap = bs - max(filled, 0)
                bid = r.block_ids[-1]
                empty[bid] = min(empty.get(bid, gap), gap)
    live = list(core.scheduler.running) + list(core.scheduler.waiting)
    shared = {r.seq_id: sum(1 for b in r.blocks if b.ref_cnt > 1) for r in live}
    return pool.num_used_blocks * bs - sum(empty.values()), shared


def test_vectorised_block_figures_equal_the_block_by_block_ones():
    rng = random.Random(5)
    core = make_core(blocks=48, block_size=4, budget=24, max_seqs=8)
    prefix = [rng.randrange(10, 500) for _ in range(9)]
    for i in range(40):
        if rng.random() < 0.4:
            n = rng.choice((1, 1, 2, 3))
            prompt = prefix + [rng.randrange(10, 500) for _ in range(rng.randrange(1, 12))]
            sp = SamplingParams(n=n, max_tokens=rng.randrange(1, 12), temperature=1.0, seed=i)
            core.add_request(f"r{i}", prompt, sp)
        if rng.random() < 0.1 and core.scheduler.running:
            core.abort_request(rng.choice(core.scheduler.running).request_id)
        core.step()
        snap = core.snapshot()
        slots, shared = _reference(core)
        assert snap.num_used_token_slots == slots
        seq = {(r.request_id + (f"#{r.index}" if r.index else "")): r for r in snap.requests}
        assert {k: r.num_shared_blocks for k, r in seq.items()} == shared
        live = list(core.scheduler.running) + list(core.scheduler.waiting)
        assert [r.block_ids for r in snap.requests] == [
            b"".join(i.to_bytes(4, "little") for i in r.block_ids) for r in live
        ]


def test_snapshot_copies_what_it_reports():
    core = make_core(blocks=16, block_size=4)
    core.add_request("a", list(range(10, 20)), SamplingParams(max_tokens=3, temperature=0.0))
    core.step()
    snap = core.snapshot()
    counters = core.scheduler.counters
    assert snap.counters is not counters
    steps, fbr = snap.counters.steps, dict(snap.counters.finished_by_reason)
    while core.has_unfinished():
        core.step()
    assert counters.steps > steps and counters.finished_by_reason != fbr
    assert snap.counters.steps == steps and snap.counters.finished_by_reason == fbr


def test_status_is_a_view_of_the_snapshot():
    core = make_core(blocks=16, block_size=4)
    core.add_request("a", list(range(10, 20)), SamplingParams(max_tokens=8, temperature=0.0))
    core.add_request("b", list(range(10, 30)), SamplingParams(max_tokens=8, temperature=0.0))
    core.step()
    snap = core.snapshot()
    status = status_view(snap)
    assert status == core.status() | {"uptime_s": status["uptime_s"]}
    assert status["kv"]["num_used_blocks"] == snap.num_used_blocks
    assert status["config"] == snap.config
    rows = {r["request_id"]: r for r in status["requests"]}
    assert rows["a"]["admitted"] and rows["a"]["num_cached_tokens"] == 0
    assert status["last_steps"][-1]["step_id"] == snap.steps[-1].step_id


def test_not_admitted_is_a_flag_not_a_negative_count():
    core = make_core(blocks=16, block_size=4, max_seqs=1)
    core.add_request("a", list(range(10, 20)), SamplingParams(max_tokens=8, temperature=0.0))
    core.add_request("b", list(range(10, 20)), SamplingParams(max_tokens=8, temperature=0.0))
    core.step()
    rows = {r.request_id: r for r in core.snapshot().requests}
    assert rows["a"].admitted and not rows["b"].admitted
    assert rows["b"].num_cached_tokens == 0
