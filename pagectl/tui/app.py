"""``PagectlTop``: the live KV-cache operator console.

The app is handed an ``AdminSource`` (live ZMQ, a replay, or a fake in tests) and never does
I/O on the event loop: a worker pumps telemetry frames, decoding and block classification run
in a thread, and every command is its own worker whose answer (accepted, or the daemon's
error) is shown as a notice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer

from pagectl.engine.commands import (
    Abort,
    Command,
    CommandError,
    InspectBlock,
    Pause,
    ResetPrefixCache,
    Resume,
    SetConfig,
    SetPrefixCaching,
)
from pagectl.engine.telemetry import RequestRow, TelemetrySnapshot
from pagectl.tui import fmt
from pagectl.tui.blockmodel import block_ids, seq_id
from pagectl.tui.connection import (
    CONNECTING,
    LIVE,
    REPLAY,
    REPLAY_ENDED,
    REPLAY_PAUSED,
    STALE,
    Connection,
)
from pagectl.tui.history import History
from pagectl.tui.knobs import BUDGET, MAX_SEQS, Knob, step
from pagectl.tui.palette import ConsoleCommands
from pagectl.tui.prepare import Prepared, prepare
from pagectl.tui.recording import RecordWriter
from pagectl.tui.screens.confirm import ConfirmScreen
from pagectl.tui.screens.help import HelpScreen
from pagectl.tui.screens.prompt import ValuePrompt
from pagectl.tui.source import AdminSource, PlaybackControl
from pagectl.tui.widgets.block_detail import BlockDetail, Inspection
from pagectl.tui.widgets.block_map import BlockMapView
from pagectl.tui.widgets.event_log import EventLog
from pagectl.tui.widgets.gauges import Gauges
from pagectl.tui.widgets.header import ConsoleHeader
from pagectl.tui.widgets.legend import Legend
from pagectl.tui.widgets.requests_table import RequestsTable
from pagectl.tui.widgets.trends import Trends

# Actions that send a command to the daemon: greyed out unless the control channel works.
CONTROL_ACTIONS = frozenset(
    {"toggle_prefix_caching", "budget", "max_seqs", "reset_prefix_cache", "abort"}
)


def describe_result(command: Command, result: dict) -> str:
    """One line for the operator from a command's result."""
    if "name" in result and "old" in result:
        return f"{result['name']}: {result['old']} → {result['new']}"
    if isinstance(command, ResetPrefixCache):
        return f"prefix cache reset: {fmt.count(result.get('released_blocks', 0))} cached blocks released"
    if isinstance(command, (Pause, Resume)):
        return "admission paused" if result.get("paused") else "admission resumed"
    if isinstance(command, Abort):
        return f"aborted {result.get('aborted', command.request_id)}"
    return ", ".join(f"{k}={v}" for k, v in result.items()) or "ok"


class PagectlTop(App[None]):
    """The console. ``clock`` (time.time by default) measures telemetry age."""

    CSS_PATH = "app.tcss"
    TITLE = "pagectl top"
    COMMANDS = App.COMMANDS | {ConsoleCommands}
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
        Binding("question_mark", "help", "Help", key_display="?", id="pagectl.help"),
        Binding("q", "quit", "Quit", id="pagectl.quit"),
    ]

    def __init__(
        self,
        source: AdminSource,
        *,
        clock: Callable[[], float] = time.time,
        record_path: str | None = None,
        stale_after: float = 3.0,
        poll_interval: float = 0.25,
    ) -> None:
        super().__init__()
        self.source = source
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
        yield self.header_panel
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
        self._refresh_panels()
        self.block_map.focus()
        self.set_interval(0.5, self._tick)
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
            self.frames_received += 1
            per = self.block_map.per
            try:
                prepared = await asyncio.to_thread(prepare, frame, per, self._recorder)
            except Exception as e:  # a frame we cannot read must not stop the console
                self.event_log.note(self.clock(), f"bad telemetry frame: {e}", "error")
                continue
            self.apply(prepared)

    def apply(self, prepared: Prepared) -> None:
        """Show a prepared snapshot in every panel."""
        snap = prepared.snapshot
        if self._last_seq is not None and snap.seq > self._last_seq + 1:
            self.frames_skipped += snap.seq - self._last_seq - 1
        self._last_seq = snap.seq
        self.current = prepared
        self._received_at = prepared.received_at
        self.history.update(snap)
        self.block_map.set_states(prepared.states, prepared.cells)
        self.event_log.show_events(snap.events, snap.start_time)
        self.requests_table.show_rows(snap.requests)
        self._update_spotlight()
        self._refresh_panels()
        self.frames_applied += 1

    @property
    def snapshot(self) -> TelemetrySnapshot | None:
        return self.current.snapshot if self.current else None

    @property
    def config(self) -> dict:
        snap = self.snapshot
        return snap.config if snap is not None else {}

    def _refresh_panels(self) -> None:
        snap = self.snapshot
        self._update_link()
        self.header_panel.show(snap, self.link)
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
        src = self.source
        replay = isinstance(src, PlaybackControl)
        now = src.now() if isinstance(src, PlaybackControl) else self.clock()
        age = None if self._received_at is None else max(0.0, now - self._received_at)
        if isinstance(src, PlaybackControl):
            state = REPLAY_ENDED if src.finished else REPLAY_PAUSED if src.paused else REPLAY
        elif age is None:
            state = CONNECTING
        else:
            state = STALE if age > self.stale_after else LIVE
        link = Connection(
            state,
            src.label,
            age,
            getattr(src, "detail", ""),
            src.read_only_reason if not src.can_control else "",
            src.speed if isinstance(src, PlaybackControl) else 1.0,
            src.position() if isinstance(src, PlaybackControl) else None,
        )
        old = self.link
        self.link = link
        changed = (old.state, old.read_only_reason) != (link.state, link.read_only_reason)
        if (changed or replay) and self.screen_stack:
            self.refresh_bindings()
        if hasattr(self, "body"):
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
            self.inspection = Inspection(block_id, result, "ok")
        except CommandError as e:
            self.inspection = Inspection(block_id, None, f"{e.kind}: {e.message}")
        self._refresh_detail()

    # -- commands -----------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        replay = isinstance(self.source, PlaybackControl)
        if action == "speed":
            return replay
        if action == "pause":
            return True if replay else (True if self.control_ready else None)
        if action in CONTROL_ACTIONS:
            if replay:
                return None
            if not self.control_ready:
                return None
            if action == "abort" and self.selected_request is None:
                return None
        return True

    def send_command(self, command: Command, what: str):
        """Send ``command`` in a worker; the answer becomes a notice (and the worker's result)."""
        return self.run_worker(self._send(command, what), group="control", exit_on_error=False)

    async def _send(self, command: Command, what: str) -> dict | None:
        try:
            result = await self.source.send(command)
        except CommandError as e:
            text = f"{what}: {e.kind} — {e.message}"
            self.answers.append((command, False, text))
            self.notify(text, title="Refused", severity="error", timeout=8)
            self.event_log.note(self.clock(), f"{what} refused: {e.kind}: {e.message}", "error")
            return None
        text = describe_result(command, result)
        self.answers.append((command, True, text))
        self.notify(text, title="Accepted")
        snap = self.snapshot
        if snap is not None and "name" in result and "new" in result:
            # Until the next snapshot says so, show (and step from) the new value.
            snap.config[result["name"]] = result["new"]
            self._refresh_panels()
        return result

    def action_toggle_prefix_caching(self) -> None:
        on = bool(self.config.get("enable_prefix_caching", True))
        self.send_command(
            SetPrefixCaching(enabled=not on), "prefix caching off" if on else "prefix caching on"
        )

    def _step_knob(self, knob: Knob, direction: int) -> None:
        cfg = self.config
        current = cfg.get(knob.name)
        if not isinstance(current, int):
            return
        new = step(knob, current, direction, cfg)
        if new == current:
            self.notify(f"{knob.name} is already at its limit ({current})", severity="warning")
            return
        self.set_knob(knob, new)

    def action_budget(self, direction: int) -> None:
        self._step_knob(BUDGET, direction)

    def action_max_seqs(self, direction: int) -> None:
        self._step_knob(MAX_SEQS, direction)

    def set_knob(self, knob: Knob, value: int) -> None:
        self.send_command(SetConfig(name=knob.name, value=value), f"set {knob.name} {value}")

    def prompt_knob(self, knob: Knob) -> None:
        cfg = self.config
        high = cfg.get(knob.limit_key) if knob.limit_key else None
        prompt = ValuePrompt(
            f"Set {knob.name}",
            int(cfg.get(knob.name, 0)),
            knob.low,
            high if isinstance(high, int) else None,
            knob.help,
        )
        self.push_screen(
            prompt, lambda value: self.set_knob(knob, value) if value is not None else None
        )

    def action_reset_prefix_cache(self) -> None:
        snap = self.snapshot
        cached = snap.num_cached_free_blocks if snap else 0
        self.push_screen(
            ConfirmScreen(
                "Reset the prefix cache?",
                f"{fmt.count(cached)} cached blocks will be released; running requests keep theirs.",
            ),
            lambda yes: (
                self.send_command(ResetPrefixCache(), "reset prefix cache") if yes else None
            ),
        )

    def action_pause(self) -> None:
        src = self.source
        if isinstance(src, PlaybackControl):
            src.set_paused(not src.paused)
            self._tick()
            return
        paused = bool(self.config.get("paused")) or (
            self.snapshot is not None and self.snapshot.engine_state == "paused"
        )
        if paused:
            self.send_command(Resume(), "resume admission")
        else:
            self.send_command(Pause(), "pause admission")

    def action_abort(self) -> None:
        row = self.selected_request
        if row is None:
            return
        samples = sum(
            1
            for r in (self.snapshot.requests if self.snapshot else [])
            if r.request_id == row.request_id
        )
        detail = f"{samples} samples, " if samples > 1 else ""
        self.push_screen(
            ConfirmScreen(
                f"Abort request {row.request_id}?",
                f"Its sequences ({detail}{row.num_output_tokens} tokens generated in {seq_id(row)}) "
                "end with finish reason 'abort' and their blocks are freed.",
            ),
            lambda yes: (
                self.send_command(Abort(request_id=row.request_id), f"abort {row.request_id}")
                if yes
                else None
            ),
        )

    def action_speed(self, factor: float) -> None:
        src = self.source
        if isinstance(src, PlaybackControl):
            src.set_speed(src.speed * factor)
            self.notify(f"replay speed {src.speed:g}x")
            self._tick()

    def action_help(self) -> None:
        cost = self.current.cost_s * 1000 if self.current else 0.0
        diagnostics = (
            f"Frames: {fmt.count(self.frames_received)} received, {fmt.count(self.frames_applied)} shown, "
            f"{fmt.count(self.frames_skipped)} skipped by conflation; last decode+prepare {cost:.1f} ms."
        )
        self.push_screen(HelpScreen(diagnostics))

    def sort_requests(self, column: str | None) -> None:
        table = self.requests_table
        if column is not None and column == table.sort_column:
            table.sort_by(column, not table.sort_reverse)
        else:
            table.sort_by(column, reverse=column not in (None, "id", "state"))

    def map_fit(self) -> None:
        self.block_map.action_zoom_fit()


def run_console(source: AdminSource, **kw) -> None:
    """Run the console in the terminal until the operator quits."""
    PagectlTop(source, **kw).run()


__all__ = ["PagectlTop", "describe_result", "run_console"]
