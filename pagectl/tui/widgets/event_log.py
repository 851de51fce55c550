"""The event log: preemptions, configuration changes, cache resets, rejections, aborts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rich.text import Text
from textual.widgets import RichLog

from pagectl.engine.telemetry import Event
from pagectl.tui import fmt

KIND_STYLES = {
    "preemption": "bold #ff7b72",
    "config": "bold #58a6ff",
    "prefix_cache_reset": "bold #4c8fd6",
    "rejected": "bold #da3633",
    "pause": "bold #d8a32b",
    "resume": "bold #3fb950",
    "abort": "bold #c965e0",
    "error": "bold #ffffff on #da3633",
    "kv_capacity": "bold #d8a32b",
    "console": "bold #8b949e",
}
KIND_LABELS = {"prefix_cache_reset": "cache reset", "kv_capacity": "kv capacity"}


def render_event(ev: Event) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(fmt.clock_time(ev.time), style="#8b949e")
    label = KIND_LABELS.get(ev.kind, ev.kind)
    t.append(f" {label:<11} ", style=KIND_STYLES.get(ev.kind, "bold"))
    t.append(ev.message)
    return t


class EventLog(RichLog, can_focus=False):
    """Appends events it has not shown yet (the snapshot carries the most recent ones).

    Not focusable, so that tab goes straight between the map and the requests table; the
    mouse wheel still scrolls it.
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes, max_lines=1000, wrap=False, markup=False)
        self.last_event_id = 0
        self._start_time: float | None = None
        # Daemon events shown so far, by kind.
        self.kind_counts: Counter[str] = Counter()

    def show_events(self, events: Sequence[Event], start_time: float) -> None:
        if self._start_time is not None and start_time != self._start_time:
            # Another daemon (or a restart): its event ids start again at 1.
            self.last_event_id = 0
            self.write(Text("── daemon restarted ──", style="bold #d8a32b"))
        self._start_time = start_time
        for ev in events:
            if ev.event_id > self.last_event_id:
                self.write(render_event(ev))
                self.last_event_id = ev.event_id
                self.kind_counts[ev.kind] += 1

    def note(self, when: float, message: str, kind: str = "console") -> None:
        """A line from the console itself (a refused command, a lost link)."""
        self.write(render_event(Event(0, when, kind, message)))
