"""Turn block-map cells into ``Strip``s, one screen row at a time (Textual's line API).

Only visible rows are ever rendered, and a row is a handful of segments (runs of cells with
the same look are merged), so drawing costs O(visible cells), whatever the pool size.
"""

from __future__ import annotations

from rich.color import Color
from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip

from pagectl.tui.blockmodel import FREE, NUM_STATES, CellLayout, Cells

# Colour of each block state (index = state), chosen to stay apart on dark and light themes.
STATE_COLORS = (
    "#4e5561",  # free
    "#4c8fd6",  # cached (evictable, holds a prefix)
    "#3fb950",  # in use
    "#d8a32b",  # partial last block
    "#b98ad6",  # shared x2
    "#c965e0",  # shared x3-4
    "#e23fd6",  # shared x5-8
    "#ff2f8f",  # shared x9+
)
GLYPHS = ("·", "░", "▒", "▓", "█", "▄")
GUTTER_STYLE = Style(color="#6e7681")

# Look of a cell: normal, dimmed (outside the highlighted request), or under the cursor.
NORMAL, DIMMED, CURSOR = 0, 1, 2


def _dim(hex_color: str, amount: float = 0.7) -> str:
    c = Color.parse(hex_color).get_truecolor()
    bg = (22, 27, 34)
    r, g, b = (round(x + (y - x) * amount) for x, y in zip(c, bg, strict=True))
    return f"#{r:02x}{g:02x}{b:02x}"


class CellStyles:
    """Styles per (state, look), built once."""

    def __init__(self) -> None:
        self.styles: dict[tuple[int, int], Style] = {}
        for state in range(NUM_STATES):
            color = STATE_COLORS[state]
            self.styles[state, NORMAL] = Style(color=color)
            self.styles[state, DIMMED] = Style(color=_dim(color))
            cursor_bg = "#8b949e" if state == FREE else color
            self.styles[state, CURSOR] = Style(color="#ffffff", bgcolor=cursor_bg, bold=True)


STYLES = CellStyles()


def render_row(
    layout: CellLayout,
    cells: Cells,
    y: int,
    *,
    cursor: int | None = None,
    spotlight: set[int] | None = None,
    width: int | None = None,
) -> Strip:
    """Row ``y`` of the map: the gutter (first block of the row) then the cells.

    ``spotlight``: cells to keep at full colour while every other cell is dimmed (the
    selected request's blocks); None: nothing dimmed.
    """
    cols = layout.cols
    start = y * cols
    end = min(start + cols, len(cells.glyphs))
    segments = []
    if start < end:
        segments.append(Segment(f"{start * layout.per:>{layout.gutter - 1},} ", GUTTER_STYLE))
    else:
        segments.append(Segment(" " * layout.gutter))
    glyphs = cells.glyphs[start:end].tolist()
    colors = cells.colors[start:end].tolist()
    double = layout.cell_width == 3
    pad = " " if layout.cell_width >= 2 else ""
    styles = STYLES.styles
    run_text: list[str] = []
    run_key: tuple[int, int] | None = None
    for i, (g, c) in enumerate(zip(glyphs, colors, strict=True)):
        cell = start + i
        if cell == cursor:
            look = CURSOR
        elif spotlight is not None and cell not in spotlight:
            look = DIMMED
        else:
            look = NORMAL
        key = (c, look)
        if key != run_key:
            if run_text and run_key is not None:
                segments.append(Segment("".join(run_text), styles[run_key]))
            run_text = []
            run_key = key
        glyph = GLYPHS[g] * 2 if double else GLYPHS[g]
        if look == CURSOR and pad:
            # The cursor covers the glyph only; its gap keeps the neighbour's look.
            segments.append(Segment(glyph, styles[key]))
            run_key = None
            run_text = [pad]
            continue
        run_text.append(glyph + pad)
    if run_text:
        segments.append(Segment("".join(run_text), styles[run_key] if run_key else Style()))
    strip = Strip(segments)
    if width is not None:
        strip = strip.adjust_cell_length(width)
    return strip
