"""The console driven by Textual's Pilot with a fake source: keys, panels, selection, modes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from test_tui_scenarios import NOW, busy_snapshots, huge_snapshot, idle_snapshots

from pagectl.engine.commands import (
    Abort,
    CommandError,
    InspectBlock,
    Pause,
    ResetPrefixCache,
    Resume,
    SetConfig,
    SetPrefixCaching,
)
from pagectl.tui.app import PagectlTop
from pagectl.tui.blockmodel import block_ids, seq_id
from pagectl.tui.connection import LIVE, STALE
from pagectl.tui.fake_source import FakeSource
from pagectl.tui.widgets.block_detail import BlockDetail
from pagectl.tui.widgets.block_map import BlockMapView
from pagectl.tui.widgets.event_log import EventLog
from pagectl.tui.widgets.gauges import Gauges
from pagectl.tui.widgets.header import ConsoleHeader
from pagectl.tui.widgets.requests_table import RequestsTable
from pagectl.tui.widgets.trends import Trends

SIZE = (160, 48)


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_app(snaps, **kw) -> tuple[PagectlTop, FakeSource, Clock]:
    clock = Clock()
    src = FakeSource(clock=clock, **kw)
    for s in snaps:
        src.push(s)
    return PagectlTop(src, clock=clock), src, clock


async def wait_until(pilot, predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    """Let the app run until ``predicate()`` holds, polling for about ``timeout`` s; its value."""
    for _ in range(round(timeout / 0.01)):
        if predicate():
            return True
        await pilot.pause(0.01)
    return bool(predicate())


async def settle(pilot, app: PagectlTop, frames: int) -> None:
    await wait_until(pilot, lambda: app.frames_applied >= frames)
    assert app.frames_applied >= frames
    await pilot.pause()


async def wait_answers(pilot, app: PagectlTop, n: int) -> None:
    await wait_until(pilot, lambda: len(app.answers) >= n, 3.0)
    assert len(app.answers) >= n, app.answers


def inspected(app: PagectlTop) -> bool:
    """The daemon's answer about the selected block has arrived."""
    return app.inspection is not None and app.inspection.status == "ok"


def text_of(widget) -> str:
    r = widget.render()
    return str(getattr(r, "plain", r))


# -- keys send the right commands ---------------------------------------------------------


async def test_keys_send_commands_and_show_answers():
    snaps = busy_snapshots()[-1:]
    app, src, _ = make_app(snaps)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        await pilot.press("p")
        await wait_answers(pilot, app, 1)
        assert src.sent[-1] == SetPrefixCaching(enabled=False)
        assert app.answers[-1] == (src.sent[-1], True, "enable_prefix_caching: True → False")
        # The answer shows at once: the header reads OFF before the next snapshot.
        assert "prefix cache OFF" in text_of(app.query_one(ConsoleHeader))

        await pilot.press("right_square_bracket")  # ]: budget 192 -> 240
        await wait_answers(pilot, app, 2)
        assert src.sent[-1] == SetConfig(name="max_num_batched_tokens", value=240)
        await pilot.press("right_square_bracket")  # steps from the accepted value
        await wait_answers(pilot, app, 3)
        assert src.sent[-1] == SetConfig(name="max_num_batched_tokens", value=300)
        await pilot.press("left_square_bracket")  # 300 / 1.25, to a multiple of 64
        await wait_answers(pilot, app, 4)
        assert src.sent[-1] == SetConfig(name="max_num_batched_tokens", value=256)

        await pilot.press("left_curly_bracket")  # {: running cap 16 -> 13
        await wait_answers(pilot, app, 5)
        assert src.sent[-1] == SetConfig(name="max_num_seqs", value=13)
        await pilot.press("right_curly_bracket")
        await wait_answers(pilot, app, 6)
        assert src.sent[-1] == SetConfig(name="max_num_seqs", value=16)

        await pilot.press("space")
        await wait_answers(pilot, app, 7)
        assert src.sent[-1] == Pause()
        assert app.answers[-1][2] == "admission paused"


async def test_running_cap_at_its_limit_sends_nothing():
    snaps = busy_snapshots()[-1:]
    app, src, _ = make_app(snaps)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        assert app.config["max_num_seqs"] == app.config["max_num_seqs_limit"] == 16
        await pilot.press("right_curly_bracket")
        await pilot.pause(0.05)
        assert src.sent == []


async def test_space_resumes_when_paused():
    snaps = idle_snapshots()
    snaps[-1].engine_state = "paused"
    snaps[-1].config["paused"] = True
    app, src, _ = make_app(snaps)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        assert " PAUSED " in text_of(app.query_one(ConsoleHeader))
        await pilot.press("space")
        await wait_answers(pilot, app, 1)
        assert src.sent == [Resume()]


async def test_reset_prefix_cache_asks_first():
    snaps = busy_snapshots()[-1:]
    app, src, _ = make_app(snaps)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        await pilot.press("r")
        await pilot.pause()
        await pilot.press("n")  # declined: nothing sent
        await pilot.pause(0.05)
        assert src.sent == []
        await pilot.press("r")
        await pilot.pause()
        await pilot.press("y")
        await wait_answers(pilot, app, 1)
        assert src.sent == [ResetPrefixCache()]
        cached = snaps[-1].num_cached_free_blocks
        assert app.answers[-1][2] == f"prefix cache reset: {cached} cached blocks released"


async def test_abort_the_selected_request_after_confirming():
    snaps = busy_snapshots()[-1:]
    app, src, _ = make_app(snaps)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        assert app.check_action("abort", ()) is None  # no request selected yet
        await pilot.press("tab")  # the requests table
        await pilot.press("down")  # second row: "sample" (n=3)
        await pilot.pause()
        row = app.selected_request
        assert row is not None and seq_id(row) == "sample"
        assert app.check_action("abort", ()) is True
        await pilot.press("k")
        await pilot.pause()
        await pilot.press("y")
        await wait_answers(pilot, app, 1)
        assert src.sent == [Abort(request_id="sample")]
        assert app.answers[-1][2] == "aborted sample"


async def test_refusals_are_shown_and_logged():
    def refuse(cmd):
        raise CommandError("invalid_value", "max_num_batched_tokens must be in [1, 1024], got 9999")

    snaps = busy_snapshots()[-1:]
    app, src, _ = make_app(snaps, responder=refuse)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        await pilot.press("right_square_bracket")
        await wait_answers(pilot, app, 1)
        _, ok, text = app.answers[-1]
        assert not ok
        assert "invalid_value" in text and "must be in [1, 1024]" in text
        log = "\n".join(app.query_one(EventLog).lines_text())  # entries; the panel wraps them
        assert "refused: invalid_value" in log


async def test_palette_sets_an_exact_value():
    snaps = busy_snapshots()[-1:]
    app, src, _ = make_app(snaps)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"budget 640")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_answers(pilot, app, 1)
        assert src.sent == [SetConfig(name="max_num_batched_tokens", value=640)]


# -- panels show the right figures ---------------------------------------------------------


async def test_panels_show_the_snapshot_figures():
    snaps = busy_snapshots()
    last = snaps[-1]
    app, _, _ = make_app(snaps)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        header = text_of(app.query_one(ConsoleHeader))
        assert "tiny-qwen3 · float32 · cpu · TP 1" in header
        assert "72 blocks × 16 tok = 288.0 KiB" in header
        assert "up 1h02m" in header and " RUNNING " in header
        assert "● live fake://console · age 0.0s" in header
        assert "budget 192 tok/step · max seqs 16 · prefix cache ON" in header

        gauges = text_of(app.query_one(Gauges))
        used = last.num_used_blocks
        assert f"{round(100 * used / 72)}% {used}/72" in gauges
        assert f"{last.num_cached_free_blocks} evictable" in gauges
        slots = last.num_used_token_slots
        assert f"{round(100 * slots / (72 * 16))}% {slots}/1.15k" in gauges

        trends = text_of(app.query_one(Trends))
        hits = last.counters.prefix_hits / last.counters.prefix_queries
        assert f"{round(100 * hits)}% all" in trends
        assert f"{last.counters.preemptions} total" in trends
        assert f"{last.num_running} / max 16" in trends
        assert f"{last.steps[-1].num_scheduled_tokens} / 192 budget" in trends

        table = app.query_one(RequestsTable)
        # One line per sequence, and a group line over the n=3 request's samples.
        assert table.row_count == len(last.requests) + 1
        assert table.lines_by_key["group:sample"].row.num_blocks == 13
        doc2 = table.rows_by_id["doc-2"]
        assert doc2.state == "preempted" and doc2.num_preemptions == 1
        assert [str(c) for c in table.get_row("sample#1")][7] == "3/4"

        log = "\n".join(app.query_one(EventLog).lines_text())  # entries; the panel wraps them
        assert "max_num_batched_tokens: 256 -> 192 by ctl@ops:4242" in log
        assert "preempted doc-2 (kv_blocks)" in log


async def test_sorting_the_requests_table():
    snaps = busy_snapshots()[-1:]
    app, _, _ = make_app(snaps)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        table = app.query_one(RequestsTable)
        app.sort_requests("computed")
        await pilot.pause()
        computed = [table.rows_by_id[str(k.value)].num_computed_tokens for k in table.rows]
        assert computed == sorted(computed, reverse=True)
        app.sort_requests("computed")  # again: reversed
        await pilot.pause()
        computed = [table.rows_by_id[str(k.value)].num_computed_tokens for k in table.rows]
        assert computed == sorted(computed)
        assert "by computed" in str(table.border_title)


# -- selection ------------------------------------------------------------------------------


async def test_selecting_a_block_inspects_it():
    snaps = busy_snapshots()[-1:]
    app, src, _ = make_app(snaps)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        block_map = app.query_one(BlockMapView)
        assert block_map.grid is not None and block_map.grid.per == 1
        # The first block of the system prompt: shared by chat-3 and the three samples.
        shared = int(block_ids(snaps[-1].requests[0])[0])
        block_map.select_cell(shared)
        assert await wait_until(pilot, lambda: inspected(app), 1.0)
        assert src.sent[-1] == InspectBlock(block_id=shared)
        detail = text_of(app.query_one(BlockDetail))
        assert f"block {shared}" in detail and "shared ×3-4" in detail
        assert (
            "owners chat-3, sample, sample#1, sample#2  (table position 0: tokens 0–15)" in detail
        )
        assert "refcount 4" in detail and "hash " in detail and "text   t0 t1" in detail
        await pilot.press("i")  # the ids a key away
        assert "tokens [0, 1, 2" in text_of(app.query_one(BlockDetail))
        await pilot.press("i")


async def test_arrow_keys_move_the_cursor_and_a_range_cell_shows_counts():
    snap = huge_snapshot(100_000)
    app, src, _ = make_app([snap])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, 1)
        block_map = app.query_one(BlockMapView)
        per = block_map.grid.per
        assert per > 1
        await pilot.press("right")  # the first press selects cell 0
        await pilot.press("right")
        await pilot.pause()
        assert app.selection == (per, 2 * per - 1)
        detail = text_of(app.query_one(BlockDetail))
        counts = np.bincount(app.current.states[per : 2 * per], minlength=8)
        assert f"blocks {per:,}–{2 * per - 1:,} ({per:,})" in detail
        assert f"cached {counts[1]:,}" in detail
        assert not any(isinstance(c, InspectBlock) for c in src.sent)  # ranges: no inspect
        await pilot.press("minus")  # zoom out of a fitted map: stays fitted
        await pilot.press("plus")  # zoom in: finer cells, map scrolls
        await pilot.pause()
        fine = block_map.grid.per
        assert fine < per and block_map.zoom_per == fine
        # The selection follows the zoom: the cursor's cell now covers fewer blocks, and the
        # Selection panel says which (it used to keep the old range).
        first = block_map.cursor_block
        assert app.selection == (first, first + fine - 1)
        assert f"blocks {first:,}–{first + fine - 1:,} ({fine:,})" in text_of(
            app.query_one(BlockDetail)
        )
        await pilot.press("0")
        await pilot.pause()
        assert block_map.grid.per == per and block_map.zoom_per is None
        assert app.selection[1] - app.selection[0] + 1 == per


async def test_highlighting_a_request_spotlights_its_blocks():
    snaps = busy_snapshots()[-1:]
    app, _, _ = make_app(snaps)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        block_map = app.query_one(BlockMapView)
        assert block_map._spotlight_cells is None
        await pilot.press("tab")
        # chat-3, the "sample" group and its 3 samples, then doc-0.
        await pilot.press("down", "down", "down", "down", "down")
        await pilot.pause()
        row = app.selected_request
        assert seq_id(row) == "doc-0"
        assert block_map._spotlight_cells == set(block_ids(row).tolist())
        await pilot.press("tab")  # back to the map: no spotlight
        await pilot.pause()
        assert block_map._spotlight_cells is None


# -- modes ----------------------------------------------------------------------------------


async def test_read_only_mode_greys_out_control_keys():
    snaps = busy_snapshots()[-1:]
    app, src, _ = make_app(snaps, can_control=False, read_only_reason="no control token file")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        for action in (
            "toggle_prefix_caching",
            "budget",
            "max_seqs",
            "reset_prefix_cache",
            "pause",
        ):
            assert app.check_action(action, ()) is None, action
        assert app.check_action("help", ()) is True
        await pilot.press("p", "right_square_bracket", "space", "r")
        await pilot.pause(0.05)
        assert src.sent == [] and app.answers == []
        assert "READ-ONLY  no control token file" in text_of(app.query_one(ConsoleHeader))
        footer_disabled = {
            b.action for b in app.screen.query("FooterKey") if b.has_class("-disabled")
        }
        assert {"toggle_prefix_caching", "reset_prefix_cache", "pause"} <= footer_disabled


async def test_stale_telemetry_is_marked_and_recovers():
    snaps = idle_snapshots()
    app, src, clock = make_app(snaps)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        assert app.link.state == LIVE and app.check_action("toggle_prefix_caching", ()) is True
        clock.t = NOW + 12
        app._tick()
        await pilot.pause()
        assert app.link.state == STALE
        assert app.query_one("#body").has_class("-stale")
        assert "DISCONNECTED  no telemetry for 12s" in text_of(app.query_one(ConsoleHeader))
        assert app.check_action("toggle_prefix_caching", ()) is None  # greyed out
        # The daemon comes back: a fresh frame clears the mark.
        src.push(snaps[-1], received_at=clock.t)
        await settle(pilot, app, len(snaps) + 1)
        assert app.link.state == LIVE and not app.query_one("#body").has_class("-stale")
        log = "\n".join(app.query_one(EventLog).lines_text())  # entries; the panel wraps them
        assert "telemetry lost" in log and "telemetry back" in log


@pytest.mark.parametrize("key", ["question_mark"])
async def test_help_opens_and_closes(key):
    app, _, _ = make_app(idle_snapshots()[-1:])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, 1)
        await pilot.press(key)
        await pilot.pause()
        assert type(app.screen).__name__ == "HelpScreen"
        await pilot.press("escape")
        await pilot.pause()
        assert type(app.screen).__name__ == "Screen"


# -- record and replay ----------------------------------------------------------------------


async def test_record_then_replay_with_pause_and_speed(tmp_path):
    from pagectl.tui.recording import read_recording
    from pagectl.tui.replay_source import ReplaySource

    path = str(tmp_path / "incident.pctl")
    snaps = idle_snapshots()
    src = FakeSource(clock=Clock())
    for snap in snaps:
        src.push(snap, received_at=snap.time)  # received one second apart
    app = PagectlTop(src, clock=Clock(), record_path=path)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
    recorded = list(read_recording(path))
    assert [decode_seq(data) for _, data in recorded] == [s.seq for s in snaps]

    # Snapshots 1 s apart, played at a quarter speed: the first key press lands well before
    # the end even on a loaded machine.
    replay = ReplaySource(path, speed=0.25)
    app = PagectlTop(replay)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, 1)
        assert app.check_action("toggle_prefix_caching", ()) is None  # a replay is read-only
        assert app.check_action("speed", ()) is True
        await pilot.press("space")
        assert replay.paused and app.link.state == "replay paused"
        await pilot.press("less_than_sign")
        assert replay.speed == 0.125
        await pilot.press(*["greater_than_sign"] * 9)
        assert replay.speed == 64.0
        await pilot.press("space")
        await wait_until(pilot, lambda: app.snapshot.seq >= snaps[-1].seq)
        assert app.snapshot.seq == snaps[-1].seq
        assert "replay incident.pctl" in text_of(app.header_panel)


def decode_seq(data: bytes) -> int:
    from pagectl.engine.telemetry import decode_snapshot

    return decode_snapshot(data).seq


def test_cli_refuses_contradictory_flags(tmp_path, capsys):
    from pagectl.cli import main

    assert main(["top", "--replay", str(tmp_path / "missing.pctl")]) == 2
    assert "no such recording" in capsys.readouterr().out
    assert main(["top", "--replay", "a", "--record", "b"]) == 2
    assert main(["top", "--control", "ipc:///x"]) == 2
