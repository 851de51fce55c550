"""Sparklines over time: throughput, prefix hit rate, preemptions, queue, step budget use."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widget import Widget

from pagectl.engine.telemetry import TelemetrySnapshot
from pagectl.tui import fmt
from pagectl.tui.history import History

BARS = "▁▂▃▄▅▆▇█"
LABEL_WIDTH = 13
VALUE_WIDTH = 24


def sparkline(
    values: Sequence[float | None],
    width: int,
    top: float | None = None,
    color: str | None = "#58a6ff",
) -> Text:
    """The last ``width`` values as bars scaled to ``top`` (default: their maximum).

    None (no data) is a gap. ``color`` None colours by how close a value is to ``top`` (for
    figures against a capacity, such as tokens per step against the budget).
    """
    values = list(values)[-width:]
    t = Text()
    t.append(" " * (width - len(values)))
    known = [v for v in values if v is not None]
    hi = top if top is not None else (max(known) if known else 0.0)
    for v in values:
        if v is None:
            t.append(" ")
        elif hi <= 0:
            t.append(BARS[0], style="#30363d")
        else:
            level = min(len(BARS) - 1, max(0, round(v / hi * (len(BARS) - 1))))
            t.append(BARS[level], style=color or _heat(v / hi))
    return t


def _heat(x: float) -> str:
    if x > 0.9:
        return "#ff7b72"
    if x > 0.6:
        return "#d8a32b"
    return "#3fb950"


class Trends(Widget):
    """One row per series: label, sparkline (newest right), current value."""

    DEFAULT_CSS = """
    Trends { height: auto; }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.history: History | None = None
        self.snapshot: TelemetrySnapshot | None = None

    def show(self, history: History, snap: TelemetrySnapshot | None) -> None:
        self.history = history
        self.snapshot = snap
        self.refresh()

    def get_content_height(self, container, viewport, width) -> int:  # type: ignore[override]
        return 8 if self._speculating() else 7

    def _speculating(self) -> bool:
        snap = self.snapshot
        return snap is not None and snap.config.get("speculative_method", "none") != "none"

    def render(self) -> Text:
        h, snap = self.history, self.snapshot
        width = max(8, self.size.width - LABEL_WIDTH - VALUE_WIDTH - 2)
        t = Text(no_wrap=True, overflow="ellipsis")
        if h is None or snap is None:
            t.append("waiting for telemetry…", style="italic #8b949e")
            return t
        samples = list(h.samples)
        steps = list(h.steps)
        last = samples[-1] if samples else None
        c = snap.counters
        budget = (
            steps[-1].token_budget if steps else int(snap.config.get("max_num_batched_tokens", 0))
        )
        sched = steps[-1].num_scheduled_tokens if steps else 0
        queue_top = max([max(s.running, s.waiting) for s in samples] or [1])
        rows: list[tuple[str, Text, str]] = [
            (
                "prompt tok/s",
                sparkline([s.prompt_tps for s in samples], width),
                fmt.si(last.prompt_tps) if last else "—",
            ),
            (
                "gen tok/s",
                sparkline([s.generation_tps for s in samples], width),
                fmt.si(last.generation_tps) if last else "—",
            ),
            (
                "prefix hits",
                sparkline([s.hit_rate for s in samples], width, top=1.0, color="#4c8fd6"),
                f"{fmt.pct(h.hit_rate_window)} {h.window_s:g}s · {fmt.pct(h.hit_rate_total)} all",
            ),
            (
                "preemptions",
                sparkline([float(s.preemptions) for s in samples], width, color="#ff7b72"),
                f"{fmt.count(c.preemptions)} total"
                + (f" (+{last.preemptions})" if last and last.preemptions else ""),
            ),
            (
                "running",
                sparkline(
                    [float(s.running) for s in samples], width, top=queue_top, color="#3fb950"
                ),
                f"{snap.num_running} / max {snap.config.get('max_num_seqs', '?')}",
            ),
            (
                "waiting",
                sparkline(
                    [float(s.waiting) for s in samples], width, top=queue_top, color="#d8a32b"
                ),
                f"{snap.num_waiting}",
            ),
            (
                "tokens/step",
                sparkline(
                    [float(p.num_scheduled_tokens) for p in steps],
                    width,
                    top=float(max([p.token_budget for p in steps] or [budget or 1])),
                    color=None,
                ),
                f"{fmt.count(sched)} / {fmt.count(budget)} budget",
            ),
        ]
        if self._speculating():
            # Speculative decoding: acceptance rate and mean accepted length since start.
            proposed = c.spec_decode_num_draft_tokens
            accepted = c.spec_decode_num_accepted_tokens
            drafts = c.spec_decode_num_drafts
            rows.append(
                (
                    "spec accept",
                    Text(" " * width),
                    f"{fmt.pct(accepted / proposed if proposed else 0.0)} · mean length "
                    f"{1 + accepted / drafts if drafts else 0.0:.2f} · "
                    f"K={snap.config.get('num_speculative_tokens', '?')}",
                )
            )
        for i, (label, line, value) in enumerate(rows):
            if i:
                t.append("\n")
            t.append(f"{label:<{LABEL_WIDTH}}", style="bold #c9d1d9")
            t.append_text(line)
            t.append(f"  {value}")
        return t
