"""SVG snapshots at 80x24: a beam search's group highlighted in the requests table (its
beams' blocks lit on the map), and the request detail view of the group with its text.

Regenerate after an intended change with ``pytest tests/test_tui_detail_snapshots.py
--snapshot-update`` and review the SVGs.
"""

from __future__ import annotations

import pytest
from test_tui_app import settle, wait_until
from test_tui_request_detail import beam_app, open_detail, tokens_shown

from pagectl.tui.request_groups import GROUP_PREFIX

SIZE = (80, 24)


pytestmark = pytest.mark.usefixtures("utc")  # event times in a fixed zone


def test_beam_group_highlighted(snap_compare):
    app, _, _, snaps = beam_app()

    async def ready(pilot):
        await settle(pilot, app, len(snaps))
        app.requests_table.focus()
        await pilot.pause()
        assert app.requests_table.selected_line.key == GROUP_PREFIX + "beam"

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_beam_group_detail(snap_compare):
    app, _, _, snaps = beam_app()

    async def ready(pilot):
        await settle(pilot, app, len(snaps))
        screen = await open_detail(pilot, app, GROUP_PREFIX + "beam")
        assert await wait_until(pilot, lambda: tokens_shown(screen), 3.0)
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)
