"""``PagectlTop``: the live KV-cache operator console.

The app is handed an ``AdminSource`` (live ZMQ, a replay, or a fake in tests) and never does
I/O on the event loop: a worker pumps telemetry frames, decoding and block classification run
in a thread. The app holds the layout, the telemetry pump, the link state and the selection;
the operator actions and command sending come from ``ConsoleActions`` (``actions.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer

from pagectl.control.protocol import RuntimeInfo
from pagectl.control.verdicts import Verdict, slim, verdicts
from pagectl.engine.commands import Command, CommandError, InspectBlock
from pagectl.engine.telemetry import (
    RequestRow,
    TelemetrySnapshot,
    decode_heartbeat,
    is_heartbeat,
)
from pagectl.tui.actions import ConsoleActions
from pagectl.tui.blockmodel import block_ids
from pagectl.tui.connection import (
    CONNECTING,
    LIVE,
    REPLAY,
    REPLAY_ENDED,
    REPLAY_PAUSED,
    STALE,
    Connection,
)
from pagectl.tui.daemon_choice import SelectingResolver
from pagectl.tui.detokenize import Detokenizer
from pagectl.tui.fleet_actions import FLEET_BINDINGS, FleetActions
from pagectl.tui.history import History
from pagectl.tui.palette import ConsoleCommands
from pagectl.tui.prepare import Prepared, prepare
from pagectl.tui.recording import RecordWriter
from pagectl.tui.request_detail import Target
from pagectl.tui.screens.picker import DaemonPicker
from pagectl.tui.screens.request_detail import RequestDetailScreen
from pagectl.tui.source import AdminSource, Frame, PlaybackControl
from pagectl.tui.widgets.block_detail import BlockDetail, Inspection
from pagectl.tui.widgets.block_map import BlockMapView
from pagectl.tui.widgets.event_log import EventLog
from pagectl.tui.widgets.gauges import Gauges
from pagectl.tui.widgets.header import ConsoleHeader
from pagectl.tui.widgets.legend import Legend
from pagectl.tui.widgets.requests_table import RequestsTable
from pagectl.tui.widgets.trends import Trends
from pagectl.tui.widgets.verdict_bar import VerdictBar


class PagectlTop(FleetActions, ConsoleActions, App[None]):
    """The console. ``clock`` (time.time by default) measures telemetry age."""

    CSS_PATH = "app.tcss"
    TITLE = "pagectl top"
    COMMANDS = App.COMMANDS | {ConsoleCommands}
    # The keys for ConsoleActions' actions. They stay here: Textual merges BINDINGS only from
    # DOMNode subclasses in the MRO, and the mixin is a plain class at runtime.
    BINDINGS = [
        Binding("p", "toggle_prefix_caching", "Prefix cache", id="pagectl.prefix_caching"),
        Binding(
            "right_square_bracket", "budget(1)", "Budget+", key_display="]", id="pagectl.budget_up"
        ),
        Binding(
            "left_square_bracket",
            "budget(-1)",
            "Budget-",
            key_display="[",
            id="pagectl.budget_down",
        ),
        Binding(
            "right_curly_bracket", "max_seqs(1)", "Seqs+", key_display="}", id="pagectl.max_seqs_up"
        ),
        Binding(
            "left_curly_bracket",
            "max_seqs(-1)",
            "Seqs-",
            key_display="{",
            id="pagectl.max_seqs_down",
        ),
        Binding("r", "reset_prefix_cache", "Reset cache", id="pagectl.reset_prefix_cache"),
        Binding("space", "pause", "Pause/resume", id="pagectl.pause"),
        Binding("k", "abort", "Abort", id="pagectl.abort"),
        Binding(
            "greater_than_sign", "speed(2.0)", "Faster", key_display=">", id="pagectl.replay.faster"
        ),
        Binding(
            "less_than_sign", "speed(0.5)", "Slower", key_display="<", id="pagectl.replay.slower"
        ),
        Binding("e", "event_filter", "Events", id="pagectl.event_filter"),
        Binding("v", "view", "View", id="pagectl.view"),
        Binding("i", "token_ids", "Ids/text", show=False, id="pagectl.token_ids"),
        Binding("question_mark", "help", "Help", key_display="?", id="pagectl.help"),
        Binding("q", "quit", "Quit", id="pagectl.quit"),
        *FLEET_BINDINGS,
    ]

    def __init__(
        self,
        source: AdminSource,
        *,
        clock: Callable[[], float] = time.time,
        record_path: str | None = None,
        stale_after: float = 3.0,
        poll_interval: float = 0.25,
        chooser: SelectingResolver | None = None,
        detokenizer: Detokenizer | None = None,
    ) -> None:
        super().__init__()
        self.source = source
        # Set when the source finds its daemon through a selector: with several daemons and
        # no selector, a picker asks before the telemetry pump starts.
        self.chooser = chooser
        # Turns inspected token ids into text, in a worker thread (None: ids only, or the
        # text the source itself supplies).
        self.detokenizer = detokenizer
        # The source's replay controls (None: a live source). Resolved once: isinstance against a
        # runtime-checkable Protocol costs tens of microseconds, and the link update is per frame.
        self.playback: PlaybackControl | None = (
            source if isinstance(source, PlaybackControl) else None
        )
        self.clock = clock
        self.record_path = record_path
        self.stale_after = stale_after
        self.poll_interval = poll_interval
        self.history = History()
        self.current: Prepared | None = None
        self.link = Connection(CONNECTING, source.label, None)
        self.selection: tuple[int, int] | None = None
        self.inspection: Inspection | None = None
        # The daemon's answers, newest last: (command, ok, text). Shown as notices too.
        self.answers: list[tuple[Command, bool, str]] = []
        self.frames_received = 0
        self.frames_skipped = 0
        self.frames_applied = 0
        self._recorder: RecordWriter | None = None
        self._received_at: float | None = None
        self._last_seq: int | None = None
        self.heartbeats_received = 0
        # A minute of slim snapshots, one a second, for the verdict rules; their findings.
        self.verdict_history: deque[TelemetrySnapshot] = deque(maxlen=61)
        self.verdicts: list[Verdict] = []
        # The compact layout's extra panel (see ``VIEWS``).
        self.view = "events"
        # Seconds in the current step, from the newest heartbeat (0.0 after a snapshot).
        self._busy_s = 0.0

    # -- layout -------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        # Panels are kept as attributes: ``query_one`` would search a modal screen on top.
        self.header_panel = ConsoleHeader(id="header")
        self.block_map = BlockMapView(id="map")
        self.legend = Legend(id="legend")
        self.detail = BlockDetail(id="detail")
        self.gauges = Gauges(id="gauges")
        self.trends = Trends(id="trends")
        self.event_log = EventLog(id="events")
        self.requests_table = RequestsTable(id="requests")
        self.verdict_bar = VerdictBar(id="verdicts")
        yield self.header_panel
        yield self.verdict_bar
        yield from self.compose_fleet()
        with Vertical(id="body") as body:
            self.body = body
            with Horizontal(id="top"):
                with Vertical(id="left"):
                    yield self.block_map
                    yield self.legend
                    yield self.detail
                with Vertical(id="right"):
                    yield self.gauges
                    yield self.trends
                    yield self.event_log
            yield self.requests_table
        yield Footer()

    def on_mount(self) -> None:
        if self.record_path:
            self._recorder = RecordWriter(self.record_path)
        self.detail.border_title = "Selection"
        self.gauges.border_title = "KV usage"
        self.trends.border_title = "Over time"
        self.event_log.border_title = "Events"
        self._apply_layout()
        self.verdict_bar.show([])
        self._refresh_panels()
        self.block_map.focus()
        self.set_interval(0.5, self._tick)
        choices = self.chooser.choices() if self.chooser is not None else []
        if choices:
            runtime_dir = self.chooser.runtime_dir if self.chooser is not None else ""
            self.push_screen(DaemonPicker(choices, runtime_dir or ""), self._picked)
        else:
            self._pump()

    def _picked(self, info: RuntimeInfo | None) -> None:
        if info is None:
            self.exit()
            return
        assert self.chooser is not None
        self.chooser.choose(info)
        self._pump()

    async def on_unmount(self) -> None:
        await self.source.close()
        if self._recorder is not None:
            self._recorder.close()

    # -- telemetry ----------------------------------------------------------------------

    @work(exclusive=True, group="telemetry", name="telemetry")
    async def _pump(self) -> None:
        try:
            await self.source.start()
        except Exception as e:  # keep the console up; the header says why
            self.event_log.note(self.clock(), f"cannot start: {e}", "error")
            return
        while True:
            try:
                frame = await self.source.next_frame(self.poll_interval)
            except Exception as e:
                self.event_log.note(self.clock(), f"telemetry error: {e}", "error")
                await asyncio.sleep(1.0)
                continue
            if frame is None:
                self._tick()
                continue
            if is_heartbeat(frame.data):
                self._heartbeat(frame)
                continue
            self.frames_received += 1
            per = self.block_map.per
            try:
                prepared = await asyncio.to_thread(prepare, frame, per, self._recorder)
            except Exception as e:  # a frame we cannot read must not stop the console
                self.event_log.note(self.clock(), f"bad telemetry frame: {e}", "error")
                continue
            self.apply(prepared)

    def _heartbeat(self, frame: Frame) -> None:
        """The engine is alive between snapshots (maybe busy in a long step): the link stays
        live, and the header says how long the step has run."""
        try:
            hb = decode_heartbeat(frame.data)
        except Exception:
            return
        self.heartbeats_received += 1
        self._received_at = frame.received_at
        self._busy_s = hb.busy_s
        self._tick()

    def apply(self, prepared: Prepared) -> None:
        """Show a prepared snapshot in every panel."""
        snap = prepared.snapshot
        self._busy_s = 0.0
        if self._last_seq is not None and snap.seq > self._last_seq + 1:
            self.frames_skipped += snap.seq - self._last_seq - 1
        self._last_seq = snap.seq
        self.current = prepared
        self._received_at = prepared.received_at
        self.history.update(snap)
        self._judge(snap)
        self.block_map.set_states(prepared.states, prepared.cells)
        self.event_log.show_events(snap.events, snap.start_time)
        self.requests_table.show_rows(snap.requests)
        for screen in self.screen_stack:
            if isinstance(screen, RequestDetailScreen):
                screen.show_rows(snap.requests)
        self._update_spotlight()
        self._refresh_panels()
        self.frames_applied += 1

    def _judge(self, snap: TelemetrySnapshot) -> None:
        """Keep a slim snapshot a second (a minute of them) and rerun the verdict rules."""
        hist = self.verdict_history
        if hist and (snap.start_time != hist[-1].start_time or snap.time < hist[-1].time):
            hist.clear()  # another daemon, or a restart
        if hist and snap.time - hist[-1].time < 1.0:
            return
        hist.append(slim(snap))
        self.verdicts = verdicts(hist)
        self.verdict_bar.show(self.verdicts)

    @property
    def snapshot(self) -> TelemetrySnapshot | None:
        return self.current.snapshot if self.current else None

    @property
    def config(self) -> dict:
        snap = self.snapshot
        return snap.config if snap is not None else {}

    def _refresh_panels(self) -> None:
        snap = self.snapshot
        self._tick()
        self.legend.show(self.block_map.per)
        self.gauges.show(snap)
        self.trends.show(self.history, snap)
        self._refresh_detail()

    def _refresh_detail(self) -> None:
        snap = self.snapshot
        self.detail.show(
            self.selection,
            self.current.states if self.current else None,
            snap.requests if snap else [],
            snap.blocks.block_size if snap else 16,
            self.inspection,
            self.control_ready,
        )

    # -- link state ---------------------------------------------------------------------

    def _update_link(self) -> None:
        src, replay = self.source, self.playback
        now = replay.now() if replay is not None else self.clock()
        age = None if self._received_at is None else max(0.0, now - self._received_at)
        if replay is not None:
            state = REPLAY_ENDED if replay.finished else REPLAY_PAUSED if replay.paused else REPLAY
        elif age is None:
            state = CONNECTING
        else:
            state = STALE if age > self.stale_after else LIVE
        link = Connection(
            state,
            src.label,
            age,
            src.detail,
            src.read_only_reason if not src.can_control else "",
            replay.speed if replay is not None else 1.0,
            replay.position() if replay is not None else None,
            self._busy_s if state == LIVE else 0.0,
        )
        old = self.link
        self.link = link
        # check_action depends on the link only through its state and read-only reason.
        changed = (old.state, old.read_only_reason) != (link.state, link.read_only_reason)
        if changed and self.screen_stack:
            self.refresh_bindings()
        self.body.set_class(state == STALE, "-stale")
        self.block_map.stale = state == STALE
        if old.state == LIVE and state == STALE:
            self.event_log.note(self.clock(), "telemetry lost: daemon gone or hung?", "error")
        elif old.state == STALE and state == LIVE:
            self.event_log.note(self.clock(), "telemetry back", "resume")

    def _tick(self) -> None:
        self._update_link()
        self.header_panel.show(self.snapshot, self.link)

    @property
    def control_ready(self) -> bool:
        """Commands can be sent: a control token, and a live link."""
        return self.source.can_control and self.link.state == LIVE

    def action_token_ids(self) -> None:
        """The inspected block's tokens as ids or as text."""
        self.detail.show_ids = not self.detail.show_ids
        self._refresh_detail()

    def action_event_filter(self) -> None:
        self.event_log.cycle_filter()

    # -- layout for small terminals -----------------------------------------------------

    # Compact under this many columns or rows (80x24 and 100x30 are compact).
    COMPACT_BELOW = (120, 36)
    # What the compact layout shows besides map, KV usage, events and requests (the v key).
    VIEWS = ("events", "trends", "detail")

    @property
    def compact(self) -> bool:
        return self.screen_stack[0].has_class("-compact") if self.screen_stack else False

    def on_resize(self, event) -> None:
        self._apply_layout()

    def _apply_layout(self) -> None:
        if not self.screen_stack:
            return
        w, h = self.size
        base = self.screen_stack[0]
        compact = w < self.COMPACT_BELOW[0] or h < self.COMPACT_BELOW[1]
        base.set_class(compact, "-compact")
        for view in self.VIEWS[1:]:
            base.set_class(compact and self.view == view, f"-view-{view}")
        others = {"events": "v: over time", "trends": "v: selection", "detail": "v: events"}
        hint = others[self.view] if compact else ""
        self.event_log.border_subtitle = hint if self.view == "events" else ""
        self.trends.border_subtitle = hint if self.view == "trends" else ""
        self.detail.border_subtitle = hint if self.view == "detail" else ""

    def action_view(self) -> None:
        """Compact layout: show Over time, then Selection, then back to events only."""
        self.view = self.VIEWS[(self.VIEWS.index(self.view) + 1) % len(self.VIEWS)]
        self._apply_layout()
        self._refresh_panels()

    # -- selection ----------------------------------------------------------------------

    @property
    def selected_request(self) -> RequestRow | None:
        """The request highlighted in the table, while the table has focus."""
        table = self.requests_table
        return table.selected if table.has_focus else None

    def _update_spotlight(self) -> None:
        row = self.selected_request
        self.block_map.set_spotlight(block_ids(row) if row is not None else None)

    def on_data_table_row_highlighted(self, event: RequestsTable.RowHighlighted) -> None:
        if not self.screen_stack:
            return  # a highlight queued while the app was closing: no screen left to update
        self._update_spotlight()
        self.refresh_bindings()

    def on_data_table_row_selected(self, event: RequestsTable.RowSelected) -> None:
        """Enter on a line of the requests table: that request's (or sequence's) detail."""
        line = self.requests_table.lines_by_key.get(str(event.row_key.value))
        if line is None:
            return
        target = Target(line.row.request_id, line.key if line.kind == "child" else "")
        snap = self.snapshot
        self.push_screen(
            RequestDetailScreen(
                target,
                self.source,
                self.detokenizer,
                snap.requests if snap else [],
                can_fetch=lambda: self.control_ready,
                read_only_reason=self.source.read_only_reason,
                clock=self.clock,
            )
        )

    def on_descendant_focus(self) -> None:
        self._update_spotlight()

    def on_descendant_blur(self) -> None:
        self._update_spotlight()

    def on_block_map_view_cursor_moved(self, event: BlockMapView.CursorMoved) -> None:
        self.selection = (
            None
            if event.first is None
            else (event.first, event.last if event.last is not None else event.first)
        )
        self.inspection = None
        self._refresh_detail()
        if event.first is not None and event.first == event.last and self.control_ready:
            self._inspect(event.first, 0.15)

    def on_block_map_view_inspect_requested(self, event: BlockMapView.InspectRequested) -> None:
        if self.control_ready:
            self._inspect(event.block_id, 0.0)

    @work(exclusive=True, group="inspect")
    async def _inspect(self, block_id: int, delay: float) -> None:
        self.inspection = Inspection(block_id)
        self._refresh_detail()
        if delay:
            await asyncio.sleep(delay)  # the next cursor move cancels this one
        try:
            result = await self.source.send(InspectBlock(block_id))
            detok = self.detokenizer
            if detok is not None and "text" not in result and result.get("token_ids"):
                result = dict(result)
                result["text"] = await asyncio.to_thread(detok.decode, result["token_ids"])
                if result["text"] is None:
                    result["text_error"] = detok.error
            self.inspection = Inspection(block_id, result, "ok")
        except CommandError as e:
            self.inspection = Inspection(block_id, None, f"{e.kind}: {e.message}")
        self._refresh_detail()


__all__ = ["PagectlTop"]
