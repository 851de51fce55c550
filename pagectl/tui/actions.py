"""The console's operator actions: commands sent to the daemon, knob steps, replay controls.

``ConsoleActions`` is a mixin of ``PagectlTop``: the key bindings (on the app class, where
Textual collects them) and the command palette call these methods. Every command is its own
worker whose answer (accepted, or the daemon's error) becomes a notice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pagectl.engine.commands import (
    Abort,
    Command,
    CommandError,
    Pause,
    ResetPrefixCache,
    Resume,
    SetConfig,
    SetPrefixCaching,
)
from pagectl.tui import fmt
from pagectl.tui.blockmodel import seq_id
from pagectl.tui.knobs import BUDGET, MAX_SEQS, Knob, step
from pagectl.tui.screens.confirm import ConfirmScreen
from pagectl.tui.screens.help import HelpScreen
from pagectl.tui.screens.prompt import ValuePrompt

if TYPE_CHECKING:
    from textual.app import App

    from pagectl.engine.telemetry import RequestRow, TelemetrySnapshot
    from pagectl.tui.prepare import Prepared
    from pagectl.tui.source import AdminSource, PlaybackControl
    from pagectl.tui.widgets.block_map import BlockMapView
    from pagectl.tui.widgets.event_log import EventLog
    from pagectl.tui.widgets.requests_table import RequestsTable

    _Base = App[None]
else:
    _Base = object

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


class ConsoleActions(_Base):
    """What the operator can do from ``PagectlTop``; its state and panels live on the app."""

    if TYPE_CHECKING:
        # Provided by PagectlTop.
        source: AdminSource
        playback: PlaybackControl | None
        clock: Callable[[], float]
        current: Prepared | None
        answers: list[tuple[Command, bool, str]]
        frames_received: int
        frames_skipped: int
        frames_applied: int
        block_map: BlockMapView
        event_log: EventLog
        requests_table: RequestsTable

        @property
        def snapshot(self) -> TelemetrySnapshot | None: ...
        @property
        def config(self) -> dict: ...
        @property
        def control_ready(self) -> bool: ...
        @property
        def selected_request(self) -> RequestRow | None: ...
        def _refresh_panels(self) -> None: ...
        def _tick(self) -> None: ...

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # During a replay the link is never live, so control_ready is False there.
        if action == "speed":
            return self.playback is not None
        if action == "pause":
            return True if self.playback is not None or self.control_ready else None
        if action in CONTROL_ACTIONS and (
            not self.control_ready or (action == "abort" and self.selected_request is None)
        ):
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

    @property
    def admission_paused(self) -> bool:
        """The daemon admits no new requests (its config or its engine state says so)."""
        snap = self.snapshot
        return bool(self.config.get("paused")) or (
            snap is not None and snap.engine_state == "paused"
        )

    def action_pause(self) -> None:
        playback = self.playback
        if playback is not None:
            playback.set_paused(not playback.paused)
            self._tick()
            return
        if self.admission_paused:
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
        playback = self.playback
        if playback is not None:
            playback.set_speed(playback.speed * factor)
            self.notify(f"replay speed {playback.speed:g}x")
            self._tick()

    def action_help(self) -> None:
        cost = self.current.cost_s * 1000 if self.current else 0.0
        diagnostics = (
            f"Frames: {fmt.count(self.frames_received)} received, {fmt.count(self.frames_applied)} shown, "
            f"{fmt.count(self.frames_skipped)} skipped by conflation; last decode+prepare {cost:.1f} ms."
        )
        self.push_screen(HelpScreen(diagnostics))

    def sort_requests(self, column: str | None) -> None:
        self.requests_table.sort_or_reverse(column)

    def map_fit(self) -> None:
        self.block_map.action_zoom_fit()


__all__ = ["CONTROL_ACTIONS", "ConsoleActions", "describe_result"]
