"""The event log: preemptions, configuration changes, cache resets, rejections, aborts.

Events arrive in snapshots (the most recent few dozen, each numbered by the engine). The log
keeps every one it has seen, in event-number order, each once; when the numbers jump (a
burst of events larger than one snapshot carries, or frames the console lost) it says how
many it missed. Lines wrap, so who changed a setting, a preemption's reason and its size
are always shown in full. A filter by kind (``cycle_filter``) re-renders from the kept
events.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

from rich.text import Text
from textual import events
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
    "gap": "bold #d8a32b",
    "restart": "bold #d8a32b",
}
KIND_LABELS = {"prefix_cache_reset": "cache reset", "kv_capacity": "kv capacity"}
# The filters, in the order ``cycle_filter`` steps through them: name -> kinds shown.
# Console lines, gaps and restarts show under every filter.
FILTERS: dict[str, frozenset[str] | None] = {
    "all": None,
    "config": frozenset({"config"}),
    "preemption": frozenset({"preemption"}),
    "cache": frozenset({"prefix_cache_reset", "kv_capacity"}),
    "admission": frozenset({"pause", "resume", "rejected", "abort"}),
}
_ALWAYS = frozenset({"console", "error", "gap", "restart"})
_KEPT = 2000


def render_event(ev: Event) -> Text:
    t = Text(overflow="fold")
    t.append(fmt.clock_time(ev.time), style="#8b949e")
    label = KIND_LABELS.get(ev.kind, ev.kind)
    t.append(f" {label:<11} ", style=KIND_STYLES.get(ev.kind, "bold"))
    t.append(ev.message)
    return t


class EventLog(RichLog, can_focus=False):
    """Every event seen so far, ordered and de-duplicated by event number (see module).

    Not focusable, so that tab goes straight between the map and the requests table; the
    mouse wheel still scrolls it.
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(
            id=id, classes=classes, max_lines=_KEPT, wrap=True, markup=False, min_width=20
        )
        self.last_event_id = 0
        self._start_time: float | None = None
        # Daemon events shown so far, by kind.
        self.kind_counts: Counter[str] = Counter()
        # Events missed (numbers skipped) so far.
        self.num_missed = 0
        # Everything kept, in order (daemon events, gaps, console lines).
        self.entries: deque[Event] = deque(maxlen=_KEPT)
        self.filter = "all"
        # The newest events stay in view (False once the operator scrolls back with the
        # wheel; True again at the bottom).
        self.following = True

    def on_resize(self, event: events.Resize) -> None:
        """A new size (a layout change, a view toggled in the compact layout): keep the
        newest events in view. RichLog scrolls to the end only when a line is written, so
        without this the panel kept the scroll offset of its old height and showed one
        line short of the newest event, depending on whether the size or the first lines
        came first."""
        super().on_resize(event)
        if self.following:
            self.scroll_end(animate=False, immediate=False, x_axis=False)

    def on_mouse_scroll_up(self, event: events.MouseScrollUp) -> None:
        self.following = False

    def on_mouse_scroll_down(self, event: events.MouseScrollDown) -> None:
        self.call_after_refresh(self._follow_at_end)

    def _follow_at_end(self) -> None:
        self.following = self.is_vertical_scroll_end

    def show_events(self, events: Sequence[Event], start_time: float) -> None:
        if self._start_time is not None and start_time != self._start_time:
            # Another daemon (or a restart): its event ids start again at 1.
            self.last_event_id = 0
            self._add(Event(0, start_time, "restart", "── daemon restarted ──"))
        self._start_time = start_time
        new = sorted((ev for ev in events if ev.event_id > self.last_event_id), key=_event_id)
        for ev in new:
            if ev.event_id <= self.last_event_id:
                continue  # the same number twice in one snapshot
            missed = ev.event_id - self.last_event_id - 1
            if missed > 0 and self.last_event_id > 0:
                self.num_missed += missed
                self._add(
                    Event(
                        0,
                        ev.time,
                        "gap",
                        f"── {missed} event{'s' if missed != 1 else ''} missed "
                        f"(#{self.last_event_id + 1}–#{ev.event_id - 1}) ──",
                    )
                )
            self._add(ev)
            self.last_event_id = ev.event_id
            self.kind_counts[ev.kind] += 1

    def restart_numbering(self, when: float, message: str) -> None:
        """Events from another source follow (a fleet member switched to): its numbers start
        afresh, after the line ``message``."""
        self.last_event_id = 0
        self._start_time = None
        self._add(Event(0, when, "restart", message))

    def note(self, when: float, message: str, kind: str = "console") -> None:
        """A line from the console itself (a refused command, a lost link)."""
        self._add(Event(0, when, kind, message))

    def _add(self, ev: Event) -> None:
        self.entries.append(ev)
        if self._shown(ev):
            self.write(render_event(ev))

    def _shown(self, ev: Event) -> bool:
        kinds = FILTERS[self.filter]
        return kinds is None or ev.kind in kinds or ev.kind in _ALWAYS

    def set_filter(self, name: str) -> None:
        if name not in FILTERS:
            raise ValueError(f"unknown event filter {name!r}; filters: {', '.join(FILTERS)}")
        self.filter = name
        self.border_subtitle = "" if name == "all" else f"only {name} · e: next filter"
        self.clear()
        for ev in self.entries:
            if self._shown(ev):
                self.write(render_event(ev))

    def cycle_filter(self) -> str:
        names = list(FILTERS)
        self.set_filter(names[(names.index(self.filter) + 1) % len(names)])
        return self.filter

    def lines_text(self) -> list[str]:
        """The entries the current filter shows, as plain text (one per event)."""
        return [render_event(ev).plain for ev in self.entries if self._shown(ev)]


def _event_id(ev: Event) -> int:
    return ev.event_id
