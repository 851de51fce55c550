"""SVG snapshots of the console at a fixed size: idle, busy, disconnected, huge pool.

Regenerate after an intended change with ``pytest tests/test_tui_snapshots.py
--snapshot-update`` and review the SVGs (the report opens them side by side on failure).
"""

from __future__ import annotations

import pytest
from test_tui_app import SIZE, inspected, make_app, settle, wait_until
from test_tui_scenarios import NOW, busy_snapshots, huge_snapshot, idle_snapshots

from pagectl.tui.blockmodel import block_ids
from pagectl.tui.widgets.block_map import BlockMapView

pytestmark = pytest.mark.usefixtures("utc")  # event times in a fixed zone


def test_idle(snap_compare):
    snaps = idle_snapshots()
    app, _, _ = make_app(snaps)

    async def ready(pilot):
        await settle(pilot, app, len(snaps))

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_busy_with_sharing_and_a_selected_block(snap_compare):
    snaps = busy_snapshots()
    app, _, _ = make_app(snaps)

    async def ready(pilot):
        await settle(pilot, app, len(snaps))
        shared = int(block_ids(snaps[-1].requests[0])[0])
        app.query_one(BlockMapView).select_cell(shared)
        await wait_until(pilot, lambda: inspected(app), 2.0)
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_busy_request_highlighted(snap_compare):
    snaps = busy_snapshots()
    app, _, _ = make_app(snaps)

    async def ready(pilot):
        await settle(pilot, app, len(snaps))
        await pilot.press("tab", "down")  # the "sample" request: its blocks light up
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_disconnected_read_only(snap_compare):
    snaps = busy_snapshots()
    app, _, clock = make_app(snaps, can_control=False, read_only_reason="no control token file")

    async def ready(pilot):
        await settle(pilot, app, len(snaps))
        clock.t = NOW + 12.0
        app._tick()
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_huge_pool_aggregated(snap_compare):
    snap = huge_snapshot(1_000_000)
    app, _, _ = make_app([snap])

    async def ready(pilot):
        await settle(pilot, app, 1)
        await pilot.press("right", "right", "down")  # a range cell: its counts and owners
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (200, 60)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_busy_at_terminal_size(snap_compare, size):
    """80x24 keeps the block map, KV usage, the newest events and the requests (compact);
    120x40 and 200x60 show every panel."""
    snaps = busy_snapshots()
    app, _, _ = make_app(snaps)

    async def ready(pilot):
        await settle(pilot, app, len(snaps))
        assert app.compact == (size[0] < 120)

    assert snap_compare(app, terminal_size=size, run_before=ready)


@pytest.mark.parametrize("view", ["trends", "detail"])
def test_compact_views_behind_the_v_key(snap_compare, view):
    snaps = busy_snapshots()
    app, _, _ = make_app(snaps)

    async def ready(pilot):
        await settle(pilot, app, len(snaps))
        await pilot.press(*["v"] * (1 + app.VIEWS[1:].index(view)))
        shared = int(block_ids(snaps[-1].requests[0])[0])
        app.query_one(BlockMapView).select_cell(shared)
        await wait_until(pilot, lambda: inspected(app), 2.0)
        await pilot.pause()
        assert app.view == view

    assert snap_compare(app, terminal_size=(80, 24), run_before=ready)
