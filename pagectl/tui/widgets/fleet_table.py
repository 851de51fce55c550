"""The fleet table: a row per member (engine or daemon) with its load, and the skew verdict.

Shown above the panels when the console follows a fleet (``pagectl.tui.fleet_source``); the
selected member, whose block map and requests the panels show, is marked ``▶``. A click on
a row selects that member. Refreshed twice a second from the fleet's own state.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence

from rich.text import Text
from textual import events
from textual.message import Message
from textual.widgets import Static

from pagectl.control.skew import SkewVerdict
from pagectl.tui import fmt
from pagectl.tui.fleet_source import LIVE, STALE, UNREACHABLE, FleetRow, FleetSource

# (title, width, right-aligned) of each column after the marker and key; the member column's
# width is what the terminal leaves, within MEMBER_WIDTH.
COLUMNS = (
    ("member", 0, False),
    ("state", 10, False),
    ("run", 5, True),
    ("wait", 5, True),
    ("KV", 5, True),
    ("hit", 5, True),
    ("tok/s", 7, True),
    ("preempt", 8, True),
)
MEMBER_WIDTH = (12, 28)
# Lines the verdict may take before it is cut (one on a terminal under 36 rows).
VERDICT_LINES = 2
_DIM = "#8b949e"
_STATE_STYLES = {LIVE: "#3fb950", STALE: "bold #ff7b72", UNREACHABLE: "#8b949e"}


def _cells(row: FleetRow) -> list[str]:
    s = row.stats
    if row.link == LIVE and s is not None:
        state = s.engine_state
    else:
        state = "no admin" if row.link == UNREACHABLE else row.link
    if s is None:
        return [row.label, state]
    return [
        row.label,
        state,
        str(s.num_running),
        str(s.num_waiting),
        fmt.pct(s.kv_usage),
        fmt.pct(s.hit_rate),
        "—" if s.generation_tps is None else fmt.si(s.generation_tps),
        fmt.count(s.preemptions),
    ]


def _fit(text: str, width: int, right: bool) -> str:
    if len(text) > width:
        text = text[: max(1, width - 1)] + "…"
    return text.rjust(width) if right else text.ljust(width)


def render_fleet(
    rows: Sequence[FleetRow],
    selected: int,
    verdict: SkewVerdict | None,
    width: int | None = None,
    verdict_lines: int = VERDICT_LINES,
) -> Text:
    """The table's lines, each cut to ``width``; the verdict wrapped on ``verdict_lines``
    (its summary when that is one and the whole message does not fit)."""
    lines: list[Text] = []
    fixed = 4 + sum(w + 1 for _, w, _ in COLUMNS)
    lo, hi = MEMBER_WIDTH
    columns = [(t, w or max(lo, min(hi, (width or 120) - fixed - 1)), r) for t, w, r in COLUMNS]
    head = Text("    ", style=f"bold {_DIM}")
    for title, w, right in columns:
        head.append(_fit(title, w, right) + " ")
    lines.append(head)
    for row in rows:
        mark = "▶" if row.index == selected else " "
        key = str(row.index + 1) if row.index < 9 else " "
        hot = verdict is not None and verdict.member == row.label
        t = Text(f"{mark}{key}  ", style="bold #58a6ff" if row.index == selected else _DIM)
        cells = _cells(row)
        for i, (cell, (_, w, right)) in enumerate(zip(cells, columns, strict=False)):
            style = ""
            if i == 0:
                style = "bold #d8a32b" if hot else ("bold" if row.index == selected else "")
            elif i == 1:
                style = _STATE_STYLES.get(row.link, "")
            t.append(_fit(cell, w, right) + " ", style=style)
        if (row.stats is None or row.link != LIVE) and row.detail:
            t.append(row.detail, style=_DIM)
        lines.append(t)
    if verdict is not None:
        room = max(20, (width or 120) - 4)
        text = verdict.message
        if verdict_lines == 1 and len(text) > room and verdict.summary:
            text = verdict.summary
        wrapped = textwrap.wrap(text, room)
        if len(wrapped) > verdict_lines:
            wrapped = wrapped[:verdict_lines]
            wrapped[-1] = wrapped[-1][: room - 1] + "…"
        for i, part in enumerate(wrapped):
            t = Text()
            t.append(" ▲ " if i == 0 else "   ", style="bold #0d1117 on #d8a32b" if i == 0 else "")
            t.append(f" {part}", style="#d8a32b")
            lines.append(t)
    if width is not None:
        for line in lines:
            line.truncate(width, overflow="ellipsis")
    return Text("\n", no_wrap=True).join(lines)


class FleetTable(Static):
    """The fleet table over a ``FleetSource`` (see module)."""

    DEFAULT_CSS = """
    FleetTable {
        height: auto;
        background: #161b22;
        color: #c9d1d9;
        text-wrap: nowrap;
        border-bottom: solid #30363d;
    }
    """

    class MemberClicked(Message):
        """A row was clicked: show that member."""

        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

    def __init__(
        self, fleet: FleetSource, clock: Callable[[], float], *, id: str | None = None
    ) -> None:
        super().__init__(id=id)
        self.fleet = fleet
        self.clock = clock
        self.verdict: SkewVerdict | None = None

    def on_mount(self) -> None:
        self.show()
        self.set_interval(0.5, self.show)

    def show(self) -> None:
        now = self.clock()
        self.verdict = self.fleet.verdict(now)
        short = self.app.size.height < 36
        self.update(
            render_fleet(
                self.fleet.rows(now),
                self.fleet.selected,
                self.verdict,
                self.size.width or None,
                1 if short else VERDICT_LINES,
            )
        )

    def on_click(self, event: events.Click) -> None:
        index = event.y - 1  # below the column titles
        if 0 <= index < len(self.fleet.members):
            self.post_message(self.MemberClicked(index))
