"""Verdict rules on recorded snapshot histories (written and read in the ``--record``
format), and one end to end: a small pool under load makes the console name max-num-seqs."""

from __future__ import annotations

import time

from loop_harness import LoopThread
from test_tui_scenarios import Recorder, make_core

from pagectl.control.verdicts import (
    preemption_rule,
    prefix_cache_rule,
    queue_rule,
    slim,
    verdicts,
)
from pagectl.engine.commands import Pause
from pagectl.engine.telemetry import decode_snapshot, encode_snapshot
from pagectl.tui.app import PagectlTop
from pagectl.tui.recording import RecordWriter, read_recording
from pagectl.tui.zmq_source import ZmqSource


def recorded(tmp_path, rec: Recorder):
    """The recorder's pinned history, through a recording file and back."""
    path = str(tmp_path / "history.pctl")
    w = RecordWriter(path)
    for snap in rec.pinned():
        w.write(snap.time, encode_snapshot(snap))
    w.close()
    return [decode_snapshot(data) for _, data in read_recording(path)]


def test_preemptions_name_max_num_seqs(tmp_path):
    rec = Recorder(make_core(num_blocks=48, max_seqs=16))
    for i in range(16):
        rec.add(f"r{i}", [10 + i] * 40, max_tokens=200)
    for _ in range(20):
        rec.run(6)
    h = recorded(tmp_path, rec)
    assert h[-1].counters.preemptions > 3
    v = preemption_rule(h)
    assert v is not None and v.knob == "max-num-seqs"
    assert "KV pool holds 48 blocks, running cap 16 needs ~" in v.message
    assert "lower max-num-seqs to " in v.message
    fits = int(v.message.split("lower max-num-seqs to ")[1].split()[0])
    assert 1 <= fits < 16
    assert [x.rule for x in verdicts(h)][0] == "preemption"
    # The same history with the engine idle: no verdict.
    assert preemption_rule(h[:1]) is None


def test_useless_prefix_cache_names_prefix_caching(tmp_path):
    rec = Recorder(make_core(num_blocks=256, max_seqs=8))
    for i in range(40):  # every prompt different: nothing to reuse, much left cached
        rec.add(f"u{i}", [100 + i * 7 + j for j in range(64)], max_tokens=2)
        rec.run(3)
    h = recorded(tmp_path, rec)
    v = prefix_cache_rule(h)
    assert v is not None and v.knob == "prefix-caching"
    assert v.message.startswith("prefix hit rate 0% on ") and "turn prefix caching off" in v.message
    assert queue_rule(h) is None and preemption_rule(h) is None


def test_shared_prefixes_are_no_verdict(tmp_path):
    rec = Recorder(make_core(num_blocks=256, max_seqs=8))
    for i in range(40):  # one shared 64-token prefix: high hit rate
        rec.add(f"s{i}", list(range(100, 164)) + [i + 3], max_tokens=2)
        rec.run(3)
    assert verdicts(recorded(tmp_path, rec)) == []


def test_a_growing_queue_says_what_holds_admission(tmp_path):
    rec = Recorder(make_core(num_blocks=256, max_seqs=2))
    for k in range(10):
        for i in range(3):
            rec.add(f"q{k}-{i}", [50 + i] * 20, max_tokens=100)
        rec.run(1)
    v = queue_rule(recorded(tmp_path, rec))
    assert v is not None and v.knob == "max-num-seqs"
    assert "faster than it drains" in v.message and "raise max-num-seqs above 2" in v.message
    rec2 = Recorder(make_core(num_blocks=256, max_seqs=8))
    rec2.core.apply_command(Pause(), "test")
    for k in range(10):
        rec2.add(f"p{k}", [7] * 20, max_tokens=10)
        rec2.run(1)
    assert queue_rule(recorded(tmp_path, rec2)).knob == "resume"


def test_slim_keeps_what_rules_read():
    rec = Recorder(make_core())
    rec.add("a", [5] * 40, max_tokens=8)
    rec.run(2)
    s = slim(rec.snapshots[-1])
    assert s.blocks.ref_counts == b"" and s.requests[0].block_ids == b"" and not s.events
    assert s.requests[0].num_prompt_tokens == 40 and s.counters == rec.snapshots[-1].counters


async def test_a_small_pool_under_load_makes_the_console_name_max_num_seqs(tmp_path):
    # Steps of 2 ms: each request runs for a quarter of a second, so the 20 kept in flight
    # overlap and contend for the pool however fast or slow this test's own loop tops them up
    # (with instant steps, a starved test loop could let the engine finish every request
    # between two top-ups: no preemption, an idle pool held as cache).
    engine = LoopThread(tmp_path, step_delay_s=0.002, num_kv_blocks=96).start()
    try:
        app = PagectlTop(ZmqSource(engine.endpoints))
        async with app.run_test(size=(160, 48)) as pilot:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(
                v.knob == "max-num-seqs" for v in app.verdicts
            ):
                engine.keep_streams(20, prompt_len=64, max_tokens=128)
                await pilot.pause(0.05)
            assert any(v.knob == "max-num-seqs" for v in app.verdicts), app.verdicts
            shown = str(app.verdict_bar.render())  # the bar shows what the rules found now
            assert app.verdict_bar.display and "lower max-num-seqs to" in shown
    finally:
        engine.stop()
