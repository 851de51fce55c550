"""KV usage gauges: blocks in use, token slots filled (the gap is fragmentation), cached, free."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from pagectl.engine.telemetry import TelemetrySnapshot
from pagectl.tui import fmt
from pagectl.tui.blockrender import STATE_COLORS

_EIGHTHS = " ▏▎▍▌▋▊▉"
TRACK = "#30363d"


def bar(fraction: float, width: int, color: str) -> Text:
    """A horizontal bar ``width`` cells wide, drawn to an eighth of a cell."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    t = Text()
    t.append("█" * full, style=color)
    if full < width:
        t.append(_EIGHTHS[part], style=f"{color} on {TRACK}")
        t.append(" " * (width - full - 1), style=f"on {TRACK}")
    return t


class Gauges(Static):
    """Four bars, each with its figure."""

    def show(self, snap: TelemetrySnapshot | None) -> None:
        bar_width = max(6, self.size.width - 34) if self.size.width else 30
        self.update(render_gauges(snap, bar_width))


def render_gauges(snap: TelemetrySnapshot | None, bar_width: int) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    if snap is None:
        t.append("waiting for telemetry…", style="italic #8b949e")
        return t
    n = max(1, snap.blocks.num_blocks)
    slots = n * snap.blocks.block_size
    used = snap.num_used_blocks
    cached = snap.num_cached_free_blocks
    free = snap.num_free_blocks - cached
    block_frac = used / n
    slot_frac = snap.num_used_token_slots / slots
    rows = [
        (
            "KV blocks",
            block_frac,
            STATE_COLORS[2],
            f"{fmt.pct(block_frac):>4} {fmt.si(used)}/{fmt.si(n)}",
        ),
        (
            "KV tokens",
            slot_frac,
            STATE_COLORS[3],
            f"{fmt.pct(slot_frac):>4} {fmt.si(snap.num_used_token_slots)}/{fmt.si(slots)}",
        ),
        (
            "cached",
            cached / n,
            STATE_COLORS[1],
            f"{fmt.pct(cached / n):>4} {fmt.si(cached)} evictable",
        ),
        ("free", free / n, STATE_COLORS[0], f"{fmt.pct(free / n):>4} {fmt.si(free)}"),
    ]
    for i, (label, frac, color, figure) in enumerate(rows):
        if i:
            t.append("\n")
        t.append(f"{label:<10}", style="bold #c9d1d9")
        t.append_text(bar(frac, bar_width, color))
        t.append(f" {figure}")
    frag = block_frac - slot_frac
    wasted = used * snap.blocks.block_size - snap.num_used_token_slots
    t.append("\n")
    t.append(f"{'frag':<10}", style="bold #c9d1d9")
    t.append(
        f"{fmt.pct(frag)} of the pool: {fmt.count(wasted)} empty slots in blocks in use",
        style="#8b949e",
    )
    return t
