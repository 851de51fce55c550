"""The KV block map: every block (or range of blocks) a cell, drawn with the line API.

The whole pool fits on screen by default, aggregating nice-sized ranges (1, 2, 5, 10, ...
blocks per cell) when blocks outnumber cells; ``+`` / ``-`` zoom (and the map scrolls), ``0``
fits again. A cursor selects a cell; while a request is highlighted, cells holding its
blocks keep their colour and every other cell is dimmed.
"""

from __future__ import annotations

import numpy as np
from textual import events
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from pagectl.tui import fmt
from pagectl.tui.blockmodel import CellLayout, Cells, aggregate, fit_layout, nice_steps_around
from pagectl.tui.blockrender import render_row


class BlockMapView(ScrollView, can_focus=True):
    """A ``ScrollView`` whose lines are rendered on demand from per-cell arrays."""

    BINDINGS = [
        Binding("left", "move(-1, 0)", "Left", show=False),
        Binding("right", "move(1, 0)", "Right", show=False),
        Binding("up", "move(0, -1)", "Up", show=False),
        Binding("down", "move(0, 1)", "Down", show=False),
        Binding("pageup", "move(0, -10)", "Page up", show=False),
        Binding("pagedown", "move(0, 10)", "Page down", show=False),
        Binding("home", "jump(0)", "First block", show=False),
        Binding("end", "jump(-1)", "Last block", show=False),
        Binding("enter", "inspect", "Inspect", show=False, id="pagectl.map.inspect"),
        Binding("escape", "clear_cursor", "Clear", show=False),
        Binding(
            "plus,equals_sign", "zoom(-1)", "Zoom in", key_display="+", id="pagectl.map.zoom_in"
        ),
        Binding("minus", "zoom(1)", "Zoom out", key_display="-", id="pagectl.map.zoom_out"),
        Binding("0", "zoom_fit", "Fit", show=False, id="pagectl.map.fit"),
    ]

    class CursorMoved(Message):
        """The selected cell changed: blocks ``first``..``last`` (None: no selection)."""

        def __init__(self, first: int | None, last: int | None) -> None:
            super().__init__()
            self.first = first
            self.last = last

    class InspectRequested(Message):
        """Enter on a single-block cell: ask the daemon about ``block_id``."""

        def __init__(self, block_id: int) -> None:
            super().__init__()
            self.block_id = block_id

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.states: np.ndarray | None = None
        self.grid: CellLayout | None = None
        self.cells: Cells | None = None
        # Blocks per cell chosen by zooming; None: fit the whole pool.
        self.zoom_per: int | None = None
        # The selected cell, kept as its first block so that zooming keeps it.
        self.cursor_block: int | None = None
        self._spotlight_ids: np.ndarray | None = None
        self._spotlight_cells: set[int] | None = None
        self._strips: dict[int, Strip] = {}
        # Set while telemetry is lost: the title says the picture is old.
        self._stale = False

    # -- data ---------------------------------------------------------------------------

    @property
    def stale(self) -> bool:
        return self._stale

    @stale.setter
    def stale(self, value: bool) -> None:
        if value != self._stale:
            self._stale = value
            self._update_titles()

    @property
    def per(self) -> int | None:
        """Blocks per cell of the current layout (the hint for the next snapshot's work)."""
        return self.grid.per if self.grid else None

    def set_states(self, states: np.ndarray, cells: Cells | None = None) -> None:
        """Show a new snapshot's block states; ``cells`` may hold them already folded."""
        self.states = states
        self._relayout(cells)

    def set_spotlight(self, block_ids: np.ndarray | None) -> None:
        """Keep these blocks at full colour and dim the rest (None: no highlight)."""
        self._spotlight_ids = block_ids
        self._update_spotlight()
        self._invalidate()

    def _update_spotlight(self) -> None:
        ids, layout = self._spotlight_ids, self.grid
        if ids is None or layout is None:
            self._spotlight_cells = None
        else:
            self._spotlight_cells = set(np.unique(ids // layout.per).tolist())

    def _relayout(self, cells: Cells | None = None) -> None:
        states = self.states
        if states is None:
            return
        width, height = self.size.width, self.size.height
        if width <= 0 or height <= 0:
            width, height = 80, 20  # not laid out yet; redone on resize
        layout = fit_layout(len(states), width, height, self.zoom_per)
        per_changed = self.grid is None or self.grid.per != layout.per
        self.grid = layout
        if cells is not None and cells.per == layout.per and len(cells.glyphs) == layout.num_cells:
            self.cells = cells
        else:
            self.cells = aggregate(states, layout.per)
        if self.cursor_block is not None and self.cursor_block >= len(states):
            self.cursor_block = None
        if per_changed:  # the spotlight's cells depend on its block ids and the cell size only
            self._update_spotlight()
            cell = self.cursor_cell
            if cell is not None:
                # A zoom or resize changed the cell size: the selected cell now covers another
                # range of blocks, and the Selection panel must say which.
                self.cursor_block = cell * layout.per
                self.post_message(self.CursorMoved(*layout.block_range(cell)))
        self.virtual_size = Size(layout.width, layout.rows)
        self._update_titles()
        self._invalidate()

    def _invalidate(self) -> None:
        self._strips.clear()
        self.refresh()

    def _update_titles(self) -> None:
        layout = self.grid
        if layout is None:
            return
        unit = "1 block per cell" if layout.per == 1 else f"1 cell = {fmt.count(layout.per)} blocks"
        zoom = "" if self.zoom_per is None else " (zoomed)"
        stale = " · STALE (last picture)" if self._stale else ""
        self.border_title = f"KV blocks · {fmt.count(layout.num_blocks)} · {unit}{zoom}{stale}"
        cell = self.cursor_cell
        if cell is None:
            self.border_subtitle = "arrows/click select · + - zoom"
        else:
            first, last = layout.block_range(cell)
            what = (
                f"block {fmt.count(first)}"
                if first == last
                else (f"blocks {fmt.count(first)}–{fmt.count(last)}")
            )
            self.border_subtitle = f"cell {fmt.count(cell)}: {what}"

    # -- rendering ----------------------------------------------------------------------

    @property
    def cursor_cell(self) -> int | None:
        if self.cursor_block is None or self.grid is None:
            return None
        return self.grid.cell_of(self.cursor_block)

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        row = y + scroll_y
        layout, cells = self.grid, self.cells
        if layout is None or cells is None or row >= layout.rows:
            return Strip.blank(self.size.width, self.rich_style)
        strip = self._strips.get(row)
        if strip is None:
            strip = render_row(
                layout, cells, row, cursor=self.cursor_cell, spotlight=self._spotlight_cells
            )
            self._strips[row] = strip
        return strip.crop_extend(scroll_x, scroll_x + self.size.width, self.rich_style)

    def on_resize(self, event: events.Resize) -> None:
        self._relayout()

    # -- selection ----------------------------------------------------------------------

    def select_cell(self, cell: int | None) -> None:
        layout = self.grid
        if layout is None:
            return
        if cell is None:
            self.cursor_block = None
            self.post_message(self.CursorMoved(None, None))
        else:
            cell = min(max(cell, 0), layout.num_cells - 1)
            self.cursor_block = cell * layout.per
            first, last = layout.block_range(cell)
            self._scroll_to_row(cell // layout.cols)
            self.post_message(self.CursorMoved(first, last))
        self._update_titles()
        self._invalidate()

    def _scroll_to_row(self, row: int) -> None:
        top = round(self.scroll_y)
        height = self.size.height
        if row < top:
            self.scroll_to(y=row, animate=False)
        elif height and row >= top + height:
            self.scroll_to(y=row - height + 1, animate=False)

    def action_move(self, dx: int, dy: int) -> None:
        layout = self.grid
        if layout is None:
            return
        cell = self.cursor_cell
        if cell is None:
            self.select_cell(0)
            return
        self.select_cell(cell + dx + dy * layout.cols)

    def action_jump(self, cell: int) -> None:
        if self.grid is not None:
            self.select_cell(cell if cell >= 0 else self.grid.num_cells - 1)

    def action_clear_cursor(self) -> None:
        self.select_cell(None)

    def action_inspect(self) -> None:
        layout, cell = self.grid, self.cursor_cell
        if layout is None or cell is None:
            return
        first, last = layout.block_range(cell)
        if first == last:
            self.post_message(self.InspectRequested(first))

    def on_click(self, event: events.Click) -> None:
        layout = self.grid
        offset = event.get_content_offset(self)
        if layout is None or offset is None:
            return
        x = offset.x + round(self.scroll_x) - layout.gutter
        row = offset.y + round(self.scroll_y)
        if x < 0 or x >= layout.cols * layout.cell_width:
            return
        cell = row * layout.cols + x // layout.cell_width
        if cell < layout.num_cells:
            self.focus()
            self.select_cell(cell)

    # -- zoom ---------------------------------------------------------------------------

    def action_zoom(self, direction: int) -> None:
        """direction -1: fewer blocks per cell (zoom in); 1: more (zoom out)."""
        layout = self.grid
        if layout is None:
            return
        finer, coarser = nice_steps_around(layout.per)
        fit = fit_layout(layout.num_blocks, self.size.width, self.size.height)
        per = finer if direction < 0 else coarser
        if direction > 0 and per >= fit.per:
            self.zoom_per = None  # zooming out past the whole pool: fit
        elif direction < 0 and layout.per == 1:
            return
        else:
            self.zoom_per = per
        self._relayout()
        if self.cursor_cell is not None and self.grid is not None:
            self._scroll_to_row(self.cursor_cell // self.grid.cols)

    def action_zoom_fit(self) -> None:
        self.zoom_per = None
        self._relayout()
