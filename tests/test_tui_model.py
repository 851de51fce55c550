"""The console's pure parts: block classification and folding, layout, history, knobs,
the recording format and the replay clock."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from test_tui_scenarios import NOW, busy_snapshots, huge_snapshot

from pagectl.engine.telemetry import RequestRow, encode_snapshot
from pagectl.tui.blockmodel import (
    CACHED,
    FREE,
    G_EMPTY,
    G_FULL,
    G_HALF,
    G_PARTIAL,
    G_QUARTER,
    PARTIAL,
    SHARED2,
    SHARED3,
    SHARED5,
    SHARED9,
    USED,
    aggregate,
    classify,
    fit_layout,
    nice_ceil,
    owners_in_range,
)
from pagectl.tui.history import History
from pagectl.tui.knobs import BUDGET, MAX_SEQS, step
from pagectl.tui.recording import MAGIC, RecordWriter, read_recording
from pagectl.tui.replay_source import ReplaySource


def row(rid: str, ids: list[int], computed: int, index: int = 0) -> RequestRow:
    return RequestRow(
        rid, index, "running", 0, computed, 0, computed, 0, len(ids), 0, 0, 0.0,
        np.array(ids, dtype="<u4").tobytes(),
    )  # fmt: skip


def test_classify_every_state_exactly():
    ref = bytes([0, 0, 1, 1, 2, 3, 4, 5, 8, 9, 255, 1])
    hashed = bytes([0, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0])
    # Block 3 is the last, half-filled block of a 2-block table; block 11 the last of a
    # table whose tokens exactly fill it (not partial).
    rows = [row("a", [2, 3], 24), row("b", [11], 16)]
    states = classify(ref, hashed, rows, 16)
    assert states.tolist() == [
        FREE, CACHED, USED, PARTIAL, SHARED2, SHARED3, SHARED3, SHARED5, SHARED5, SHARED9,
        SHARED9, USED,
    ]  # fmt: skip


def test_a_shared_partial_block_stays_shared():
    states = classify(bytes([2]), bytes([0]), [row("a", [0], 5), row("a", [0], 5, 1)], 16)
    assert states.tolist() == [SHARED2]


def test_aggregate_counts_and_picks_the_busiest_state():
    states = np.array(
        [FREE] * 4  # empty cell
        + [CACHED, FREE, FREE, FREE]  # a quarter busy, cached
        + [USED, USED, SHARED2, SHARED5]  # full: 2 in use vs 2 shared -> shared wins the tie
        + [PARTIAL, CACHED, CACHED, FREE]  # 3/4 busy, cached is the most common
        + [USED, FREE],  # the last cell is short
        dtype=np.uint8,
    )
    cells = aggregate(states, 4)
    assert cells.counts.tolist()[1] == [3, 1, 0, 0, 0, 0, 0, 0]
    assert cells.glyphs.tolist() == [G_EMPTY, G_QUARTER, G_FULL, 3, G_HALF]
    # Shared group shaded by the highest refcount present.
    assert cells.colors.tolist() == [FREE, CACHED, SHARED5, CACHED, USED]


def test_aggregate_one_block_per_cell():
    cells = aggregate(np.array([FREE, USED, PARTIAL, SHARED9], dtype=np.uint8), 1)
    assert cells.glyphs.tolist() == [G_EMPTY, G_FULL, G_PARTIAL, G_FULL]
    assert cells.colors.tolist() == [FREE, USED, PARTIAL, SHARED9]


def test_aggregate_a_million_blocks_matches_a_direct_count():
    snap = huge_snapshot(1_000_000)
    b = snap.blocks
    states = classify(b.ref_counts, b.hashed, snap.requests, b.block_size)
    cells = aggregate(states, 500)
    assert cells.counts.shape == (2000, 8)
    assert cells.counts.sum() == 1_000_000
    lo = 1234 * 500
    assert cells.counts[1234].tolist() == np.bincount(states[lo : lo + 500], minlength=8).tolist()


@pytest.mark.parametrize(
    ("blocks", "width", "height", "per", "cell_width"),
    [
        (72, 92, 20, 1, 3),  # small: square-ish cells
        (1000, 92, 20, 1, 1),
        (5000, 92, 20, 5, 1),
        (1_000_000, 92, 20, 1000, 1),
        (100_000, 160, 40, 20, 1),
    ],
)
def test_fit_layout_shows_the_whole_pool(blocks, width, height, per, cell_width):
    layout = fit_layout(blocks, width, height)
    assert (layout.per, layout.cell_width) == (per, cell_width)
    assert layout.rows <= height and layout.width <= width
    assert layout.block_range(layout.num_cells - 1)[1] == blocks - 1


def test_nice_cell_sizes():
    assert [nice_ceil(x) for x in (0.3, 1, 1.01, 3, 7, 11, 450, 501)] == [
        1,
        1,
        2,
        5,
        10,
        20,
        500,
        1000,
    ]


def test_owners_in_range():
    rows = [row("a", [5, 6, 7], 40), row("b", [9, 6], 20)]
    owners = owners_in_range(rows, 6, 6)
    assert [(o.seq_id, o.num_blocks, o.first_position) for o in owners] == [
        ("a", 1, 1),
        ("b", 1, 1),
    ]
    # Block 6 is a's second block (24 of its 40 tokens come after the first) and b's last.
    assert [o.fill(16) for o in owners] == [16, 4]
    assert [o.seq_id for o in owners_in_range(rows, 8, 100)] == ["b"]


def test_history_rates_and_hit_rates_from_counter_deltas():
    snaps = busy_snapshots()
    h = History(interval=1.0, window_s=3.0)
    for s in snaps:
        h.update(s)
    assert len(h.samples) == len(snaps) - 1
    a, b = snaps[-2], snaps[-1]
    last = h.samples[-1]
    assert last.generation_tps == b.counters.generation_tokens - a.counters.generation_tokens
    assert last.prompt_tps == b.counters.prompt_tokens - a.counters.prompt_tokens
    w = snaps[-4]  # the window reaches back 3 s
    dq = b.counters.prefix_queries - w.counters.prefix_queries
    assert last.hit_rate == ((b.counters.prefix_hits - w.counters.prefix_hits) / dq if dq else None)
    assert h.hit_rate_total == b.counters.prefix_hits / b.counters.prefix_queries
    assert [p.step_id for p in h.steps] == sorted({s.step_id for x in snaps for s in x.steps})
    # Another daemon: history starts again.
    other = huge_snapshot(1000)
    other.start_time = NOW - 5
    h.update(other)
    assert len(h.samples) == 0 and h.steps[-1].step_id == other.steps[-1].step_id


def test_knob_steps():
    cfg = {"max_num_batched_tokens_limit": 8192, "max_num_seqs_limit": 64}
    assert step(BUDGET, 2048, 1, cfg) == 2560
    assert step(BUDGET, 2048, -1, cfg) == 1664
    assert step(BUDGET, 8000, 1, cfg) == 8192  # capped by the daemon's limit
    assert step(BUDGET, 1, -1, cfg) == 1
    assert step(MAX_SEQS, 64, 1, cfg) == 64
    assert step(MAX_SEQS, 3, -1, cfg) == 2  # always moves by at least one
    assert step(MAX_SEQS, 3, 1, cfg) == 4


def test_recording_round_trip_and_truncated_tail(tmp_path):
    path = str(tmp_path / "rec.pctl")
    frames = [encode_snapshot(huge_snapshot(10_000, seq=i)) for i in range(3)]
    w = RecordWriter(path)
    for i, f in enumerate(frames):
        w.write(NOW + i * 0.1, f)
    w.close()
    assert (tmp_path / "rec.pctl").read_bytes()[:8] == MAGIC
    assert list(read_recording(path)) == [(NOW + i * 0.1, f) for i, f in enumerate(frames)]
    size = (tmp_path / "rec.pctl").stat().st_size
    assert size < sum(map(len, frames)) / 5  # compressed
    with open(path, "ab") as f:
        f.write(b"\x00" * 7)  # a console killed mid-header
    assert len(list(read_recording(path))) == 3


class FakeMonotonic:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def test_replay_follows_the_recorded_clock_with_pause_speed_and_conflation(tmp_path):
    path = str(tmp_path / "rec.pctl")
    w = RecordWriter(path)
    for i in range(5):
        w.write(NOW + i, encode_snapshot(huge_snapshot(100, seq=i + 1)))
    w.close()
    mono = FakeMonotonic()
    src = ReplaySource(path, monotonic=mono)
    await src.start()
    assert not src.can_control
    first = await src.next_frame(0.01)
    assert first is not None and first.received_at == NOW
    assert await src.next_frame(0.01) is None  # frame 2 is due in 1 s of playback
    mono.t += 2.5  # two frames are due: only the newest is delivered
    f = await src.next_frame(0.01)
    assert f is not None and f.received_at == NOW + 2 and src.position()[0] == 3
    src.set_paused(True)
    mono.t += 10
    assert await src.next_frame(0.01) is None
    assert src.now() == pytest.approx(NOW + 2.5)
    src.set_paused(False)
    src.set_speed(4.0)
    mono.t += 0.25  # 1 s of recording at 4x
    f = await src.next_frame(0.01)
    assert f is not None and f.received_at == NOW + 3
    mono.t += 0.25
    f = await src.next_frame(0.01)
    assert f is not None and f.received_at == NOW + 4 and src.finished
    await src.close()


def test_replay_file_must_be_a_recording(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"not a recording")
    with pytest.raises(ValueError, match="not a pagectl telemetry recording"):
        asyncio.run(ReplaySource(str(bad)).start())


def test_header_and_ctl_status_show_how_the_engine_runs():
    import msgspec

    from pagectl.cli.ctl import _memory_profile
    from pagectl.tui.connection import Connection
    from pagectl.tui.widgets.header import render_header

    snap = busy_snapshots()[-1]
    link = Connection("live", "ipc://x", 0.1)
    assert " attn " not in render_header(snap, link).plain  # unknown: not shown
    profile = dict(
        total_bytes=140 << 30,
        gpu_memory_utilization=0.9,
        used_after_load_bytes=2 << 30,
        peak_activation_bytes=3 << 30,
        profiled_tokens=8192,
        kv_budget_bytes=121 << 30,
    )
    model = msgspec.structs.replace(
        snap.model, attention_backend="triton", cuda_graph_max_batch=256, memory_profile=profile
    )
    text = render_header(msgspec.structs.replace(snap, model=model), link).plain
    assert "· attn triton + graphs" in text and "(GPU 90% of 140.0 GiB, peak act 3.0 GiB)" in text
    assert _memory_profile(profile) == (
        ", GPU 90% of 140.0 GiB: 2.0 GiB in use after loading, 3.0 GiB peak activation, "
        "121.0 GiB for KV"
    )
