"""SVG snapshots of the console over a fleet: three members (two engines, one backend on
another host) with the skew verdict at 120x40, and the second engine selected at 80x24.

Regenerate after an intended change with ``pytest tests/test_fleet_snapshots.py
--snapshot-update`` and review the SVGs.
"""

from __future__ import annotations

import pytest
from test_fleet_view import make_fleet, settle_fleet, skewed_fleet
from test_tui_app import wait_until

pytestmark = pytest.mark.usefixtures("utc")  # event times in a fixed zone

REMOTE = {"10.1.2.3:8000": "on another host: the admin channel is local, run pagectl top there"}


def test_fleet_of_three_with_the_skew_verdict(snap_compare):
    h = skewed_fleet(2)
    app, fleet, _ = make_fleet(h, unreachable=REMOTE)

    async def ready(pilot):
        await settle_fleet(pilot, app, fleet, h)
        # Away and back: the sparklines restart from the minute the fleet kept of engine 0,
        # whatever number of frames the app was handed while they streamed in.
        await pilot.press("n")
        await pilot.press("N")
        await wait_until(pilot, lambda: fleet.selected == 0 and app.snapshot is not None)
        await pilot.pause()
        assert app.fleet_table.verdict is not None

    assert snap_compare(app, terminal_size=(120, 40), run_before=ready)


def test_fleet_second_engine_selected_compact(snap_compare):
    h = skewed_fleet(2)
    app, fleet, _ = make_fleet(h)

    async def ready(pilot):
        await settle_fleet(pilot, app, fleet, h)
        await pilot.press("n")
        engine_1 = lambda: app.snapshot is not None and app.snapshot.blocks.num_blocks == 96  # noqa: E731
        assert await wait_until(pilot, engine_1)
        await pilot.pause()
        assert fleet.selected == 1 and app.compact

    assert snap_compare(app, terminal_size=(80, 24), run_before=ready)
