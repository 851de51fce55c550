"""The console's fleet: switching the panels between the members of a ``FleetSource``.

``FleetActions`` is a mixin of ``PagectlTop`` (its key bindings live on the app class, where
Textual collects them). With any other source the fleet table is absent and the keys hidden.

A switch forgets everything the panels hold of the member shown before (its sparklines,
verdict history, selection, the event numbers it reached) and restarts the telemetry worker,
so a frame of the old member still being prepared is never shown after the switch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from textual.binding import Binding

from pagectl.tui.fleet_source import FleetSource
from pagectl.tui.history import History
from pagectl.tui.widgets.fleet_table import FleetTable

if TYPE_CHECKING:
    from collections import deque
    from collections.abc import Callable

    from textual.app import App
    from textual.widget import Widget

    from pagectl.control.verdicts import Verdict
    from pagectl.engine.telemetry import TelemetrySnapshot
    from pagectl.tui.prepare import Prepared
    from pagectl.tui.source import AdminSource
    from pagectl.tui.widgets.block_detail import Inspection
    from pagectl.tui.widgets.event_log import EventLog
    from pagectl.tui.widgets.requests_table import RequestsTable
    from pagectl.tui.widgets.verdict_bar import VerdictBar

    _Base = App[None]
else:
    _Base = object

# The actions that only mean something with a fleet, and their keys (on PagectlTop).
FLEET_ACTIONS = frozenset({"member", "member_at"})
FLEET_BINDINGS = [
    Binding("n", "member(1)", "Next member", id="pagectl.fleet.next"),
    Binding("N", "member(-1)", "Previous member", show=False, id="pagectl.fleet.previous"),
    *(
        Binding(str(k), f"member_at({k - 1})", f"Member {k}", show=False, id=f"pagectl.fleet.{k}")
        for k in range(1, 10)
    ),
]


class FleetActions(_Base):
    """Fleet table and member switching for ``PagectlTop``."""

    if TYPE_CHECKING:
        # Provided by PagectlTop.
        source: AdminSource
        clock: Callable[[], float]
        history: History
        verdict_history: deque[TelemetrySnapshot]
        verdicts: list[Verdict]
        current: Prepared | None
        selection: tuple[int, int] | None
        inspection: Inspection | None
        _last_seq: int | None
        _received_at: float | None
        _busy_s: float
        event_log: EventLog
        requests_table: RequestsTable
        verdict_bar: VerdictBar

        def _pump(self) -> object: ...

        def _refresh_panels(self) -> None: ...

    fleet_table: FleetTable | None = None

    @property
    def fleet(self) -> FleetSource | None:
        return self.source if isinstance(self.source, FleetSource) else None

    def compose_fleet(self) -> Iterator[Widget]:
        """The fleet table, when the source is a fleet."""
        if self.fleet is not None:
            self.fleet_table = FleetTable(self.fleet, self.clock, id="fleet")
            yield self.fleet_table

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in FLEET_ACTIONS:
            return self.fleet is not None and len(self.fleet.members) > 1
        return super().check_action(action, parameters)

    def action_member(self, delta: int) -> None:
        """Show the next (1) or previous (-1) member."""
        if self.fleet is not None:
            self.switch_member(self.fleet.selected + delta)

    def action_member_at(self, index: int) -> None:
        """Show member ``index`` (0-based; keys 1-9)."""
        if self.fleet is not None and 0 <= index < len(self.fleet.members):
            self.switch_member(index)

    def on_fleet_table_member_clicked(self, event: FleetTable.MemberClicked) -> None:
        self.action_member_at(event.index)

    def switch_member(self, index: int) -> None:
        fleet = self.fleet
        assert fleet is not None
        if index % len(fleet.members) == fleet.selected:
            return
        fleet.select(index)
        # The sparklines start from the minute the fleet kept of this member, not empty.
        self.history = History()
        for snap in fleet.member.history:
            self.history.update(snap)
        self.verdict_history.clear()
        self.verdicts = []
        self.verdict_bar.show([])
        self.current = None
        self.selection = None
        self.inspection = None
        self._last_seq = None
        self._received_at = None
        self._busy_s = 0.0
        self.event_log.restart_numbering(self.clock(), f"── now showing {fleet.member.label} ──")
        self.requests_table.show_rows([])
        self._pump()  # exclusive: replaces the worker, and drops a frame it was preparing
        self._refresh_panels()
        if self.fleet_table is not None:
            self.fleet_table.show()
        self.refresh_bindings()
