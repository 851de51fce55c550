"""The block map's legend: one swatch per state, and how aggregated cells read."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from pagectl.tui import fmt
from pagectl.tui.blockmodel import NUM_STATES, PARTIAL, SHARED2, STATE_LABELS
from pagectl.tui.blockrender import GLYPHS, STATE_COLORS


class Legend(Static):
    """Rendered from the map's cell size: exact blocks, or ranges of ``per`` blocks."""

    # The cell size shown (-1: none yet); the legend changes only with it, not per snapshot.
    _per: int | None = -1

    def show(self, per: int | None) -> None:
        if per != self._per:
            self._per = per
            self.update(render_legend(per))


def render_legend(per: int | None) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    exact = (per or 1) == 1
    for state in range(NUM_STATES):
        if state == 0:
            glyph = GLYPHS[0]
        elif state == PARTIAL and exact:
            glyph = GLYPHS[5]
        else:
            glyph = GLYPHS[4]
        label = STATE_LABELS[state]
        if state > SHARED2:
            label = label.replace("shared ", "")
        t.append(glyph, style=STATE_COLORS[state])
        t.append(f" {label}  " if state < SHARED2 else f" {label} ", style="#c9d1d9")
    t.append(" (refcount)", style="#8b949e")
    if not exact:
        t.append("\n")
        t.append(f"1 cell = {fmt.count(per or 1)} blocks: ", style="#8b949e")
        for g in GLYPHS[:5]:
            t.append(g, style="#c9d1d9")
        t.append(" = none … over ¾ of them not free; colour = most common state", style="#8b949e")
    return t
