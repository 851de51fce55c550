"""Telemetry you can trust: heartbeats through long steps, events ordered and de-duplicated
with gaps shown, and a preemption storm (96-block pool, 20 streams) with the console
attached headless over the real engine loop."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from loop_harness import LoopThread
from test_tui_app import make_app, settle, wait_until
from test_tui_scenarios import busy_snapshots

from pagectl.engine.telemetry import Event, decode_heartbeat, decode_snapshot, is_heartbeat
from pagectl.engine_process.publisher import TelemetryPublisher
from pagectl.tui.app import PagectlTop
from pagectl.tui.connection import LIVE, STALE
from pagectl.tui.widgets.header import ConsoleHeader
from pagectl.tui.zmq_source import ZmqSource


def test_the_publisher_sends_heartbeats_while_a_step_runs(tmp_path):
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    pub.bind(f"ipc://{tmp_path}/t")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{tmp_path}/t")
    p = TelemetryPublisher(pub, heartbeat_interval=0.1).start()
    try:
        time.sleep(0.2)  # the subscription reaches the publisher
        p.publish(b"\x81\xa1a\x01", 7)  # any map: a "snapshot"
        p.step_started(42)
        got = []
        deadline = time.monotonic() + 5
        while len(got) < 4 and time.monotonic() < deadline:
            if sub.poll(500):
                frame = sub.recv()
                if got or not is_heartbeat(frame):  # idle heartbeats before it: skipped
                    got.append(frame)
        assert got[0] == b"\x81\xa1a\x01" and not is_heartbeat(got[0])
        beats = [decode_heartbeat(f) for f in got[1:]]
        assert all(is_heartbeat(f) for f in got[1:])
        assert [b.last_seq for b in beats] == [7, 7, 7] and beats[0].step_id == 42
        assert 0 < beats[0].busy_s < beats[1].busy_s < beats[2].busy_s
        p.step_finished()
    finally:
        p.close()
        ctx.destroy(linger=0)


async def test_a_long_step_is_busy_not_lost(tmp_path):
    """A 4.5 s step against a 2 s staleness limit: heartbeats (every 0.5 s) keep the link
    live and the header says the engine is busy. Without them the console calls the daemon
    gone. (The limit leaves 4 heartbeat intervals of slack, as the console's default of 3 s
    leaves 6: with 2, one late heartbeat on a loaded machine read as a loss.)"""
    engine = LoopThread(tmp_path, step_delay_s=4.5).start()
    try:
        app = PagectlTop(ZmqSource(engine.endpoints), stale_after=2.0)
        async with app.run_test(size=(160, 48)) as pilot:
            assert await wait_until(pilot, lambda: app.link.state == LIVE, 10)
            engine.submit([5, 6, 7], max_tokens=1)
            states, busy = set(), False
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                await pilot.pause(0.05)
                states.add(app.link.state)
                text = app.query_one(ConsoleHeader).render()
                busy = busy or "busy in a step for" in str(getattr(text, "plain", text))
            assert states == {LIVE}
            assert busy
            assert app.heartbeats_received >= 4
            log = app.event_log.lines_text()
            assert not any("telemetry lost" in ln for ln in log), log
    finally:
        engine.stop()


def with_events(snap, ids: list[int]):
    evs = [Event(i, snap.time, "preemption", f"preempted r{i}#0 (kv_blocks)") for i in ids]
    return msgspec.structs.replace(snap, events=evs)


async def test_events_are_ordered_deduplicated_and_gaps_shown():
    base = busy_snapshots()[-1]
    snaps = [
        with_events(base, [1, 2, 3]),
        with_events(base, [3, 2, 4, 5]),  # overlap and disorder: 4 and 5 are new
        with_events(base, [9, 10]),  # 6-8 never arrived (dropped on purpose)
    ]
    app, _, _ = make_app(snaps)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot, app, len(snaps))
        log = app.event_log
        ids = [e.event_id for e in log.entries if e.kind == "preemption"]
        assert ids == [1, 2, 3, 4, 5, 9, 10]
        assert log.num_missed == 3
        assert any("3 events missed (#6–#8)" in ln for ln in log.lines_text())


async def test_event_filters_by_kind():
    base = busy_snapshots()[-1]
    evs = [
        Event(1, base.time, "config", "max_num_seqs: 16 -> 8 by ctl@h:1 (uid 0, pid 1, peer)"),
        Event(2, base.time, "preemption", "preempted r1#0 (kv_blocks): 48 tokens to recompute"),
        Event(3, base.time, "pause", "admission paused by top@h:2"),
    ]
    app, _, _ = make_app([msgspec.structs.replace(base, events=evs)])
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot, app, 1)
        await pilot.press("e")  # config only
        assert app.event_log.filter == "config"
        assert [ln.split(" ", 2)[-1].strip() for ln in app.event_log.lines_text()] == [
            evs[0].message
        ]
        await pilot.press("e")
        assert "48 tokens to recompute" in "\n".join(app.event_log.lines_text())
        await pilot.press("e", "e")  # cache, then admission
        assert app.event_log.filter == "admission"
        assert "admission paused" in "\n".join(app.event_log.lines_text())
        await pilot.press("e")
        assert app.event_log.filter == "all" and len(app.event_log.lines_text()) == 3


class DroppingSource(ZmqSource):
    """From ``drop_after`` seconds on, drops snapshots until the events the console last saw
    have left the snapshot's window, so that it must miss some (once)."""

    def __init__(self, *a, drop_after: float, **kw) -> None:
        super().__init__(*a, **kw)
        self.drop_after = drop_after
        self.t0: float | None = None
        self.dropped = 0
        self.last_seen = 0
        self.done = False

    async def next_frame(self, timeout):
        frame = await super().next_frame(timeout)
        if frame is None or is_heartbeat(frame.data):
            return frame
        snap = decode_snapshot(frame.data)
        self.t0 = self.t0 or time.monotonic()
        dropping = (
            not self.done
            and self.last_seen > 0  # the console has seen events: now make it miss some
            and time.monotonic() - self.t0 >= self.drop_after
        )
        if dropping and (not snap.events or snap.events[0].event_id <= self.last_seen + 1):
            self.dropped += 1
            return None
        if dropping:
            self.done = True
        if snap.events:
            self.last_seen = snap.events[-1].event_id
        return frame


async def storm(tmp_path, seconds: float) -> None:
    engine = LoopThread(tmp_path, num_kv_blocks=96).start()
    try:
        src = DroppingSource(engine.endpoints, drop_after=1.0)
        app = PagectlTop(src)
        async with app.run_test(size=(120, 40)) as pilot:
            states = set()
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                engine.keep_streams(20, prompt_len=64, max_tokens=128)
                await pilot.pause(0.05)
                if app.snapshot is not None:
                    states.add(app.link.state)
            assert STALE not in states and LIVE in states
            snap = app.snapshot
            assert snap.counters.preemptions > 20, snap.counters
            lines = app.event_log.lines_text()
            assert not any("telemetry lost" in ln for ln in lines)
            ids = [e.event_id for e in app.event_log.entries if e.event_id]
            assert ids == sorted(set(ids))  # in order, each once
            assert src.done and src.dropped > 0 and app.event_log.num_missed > 0
            assert any(" missed (#" in ln for ln in lines)
    finally:
        engine.stop()


async def test_preemption_storm_short(tmp_path):
    await storm(tmp_path, 4.0)


@pytest.mark.extended
async def test_preemption_storm_60s(tmp_path):
    await storm(tmp_path, 60.0)


def test_a_stale_link_shows_the_last_seen_state_not_a_running_badge():
    from pagectl.tui.connection import Connection
    from pagectl.tui.widgets.header import render_header

    snap = busy_snapshots()[-1]
    live = render_header(snap, Connection(LIVE, "http://h:1", 0.1)).plain
    stale = render_header(snap, Connection(STALE, "http://h:1", 9.0)).plain
    assert " RUNNING " in live and "DISCONNECTED" not in live
    assert "DISCONNECTED" in stale and "RUNNING" not in stale and "last seen running" in stale
    # Cut to the terminal's width line by line: the second line (the link) never vanishes.
    narrow = render_header(snap, Connection(STALE, "http://h:1", 9.0), 80).plain.split("\n")
    assert len(narrow) == 2 and all(len(x) <= 80 for x in narrow)
    assert "DISCONNECTED" in narrow[1]
