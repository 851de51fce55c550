"""The requests table: every waiting and running sequence, sortable by any column."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual.binding import Binding
from textual.widgets import DataTable

from pagectl.engine.telemetry import RequestRow
from pagectl.tui import fmt
from pagectl.tui.request_groups import Line, lines

STATE_STYLES = {"running": "#3fb950", "waiting": "#8b949e", "preempted": "bold #ff7b72"}
_STATE_ORDER = {"running": 0, "preempted": 1, "waiting": 2}


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    # Sort key; cells are right-aligned numbers unless ``text``.
    sort: Callable[[RequestRow], Any]
    cell: Callable[[RequestRow], str]
    text: bool = False


def _blocks(r: RequestRow) -> str:
    return f"{r.num_blocks - r.num_shared_blocks}/{r.num_shared_blocks}"


def _cached(r: RequestRow) -> str:
    return fmt.count(r.num_cached_tokens) if r.admitted else "—"


COLUMNS = (
    # The id cell is the line's label (request_groups: a group, its members indented).
    Column("id", "request", lambda r: (r.request_id, r.index), lambda r: r.request_id, text=True),
    Column("state", "state", lambda r: _STATE_ORDER.get(r.state, 9), lambda r: r.state, text=True),
    Column("priority", "prio", lambda r: r.priority, lambda r: str(r.priority)),
    Column(
        "prompt", "prompt", lambda r: r.num_prompt_tokens, lambda r: fmt.count(r.num_prompt_tokens)
    ),
    Column(
        "output", "output", lambda r: r.num_output_tokens, lambda r: fmt.count(r.num_output_tokens)
    ),
    Column(
        "computed",
        "computed",
        lambda r: r.num_computed_tokens,
        lambda r: fmt.count(r.num_computed_tokens),
    ),
    Column("cached", "cached", lambda r: r.num_cached_tokens, _cached),
    Column("blocks", "blocks own/shr", lambda r: (r.num_blocks, r.num_shared_blocks), _blocks),
    Column("preemptions", "preempt", lambda r: r.num_preemptions, lambda r: str(r.num_preemptions)),
    Column("age", "age", lambda r: r.age_s, lambda r: fmt.duration(r.age_s)),
)
COLUMN_KEYS = tuple(c.key for c in COLUMNS)
_BY_KEY = {c.key: c for c in COLUMNS}


def _cell(col: Column, r: RequestRow, value: str, kind: str = "seq") -> Text:
    """The table cell showing ``value`` (``col.cell(r)``) on a line of ``kind``."""
    if col.key == "id":
        style = "bold" if kind == "group" else "#8b949e" if kind == "child" else ""
        return Text(value, style=style, justify="left")
    if col.key == "state":
        return Text(value, style=STATE_STYLES.get(value, ""))
    if col.key == "preemptions" and r.num_preemptions:
        return Text(value, style="bold #ff7b72", justify="right")
    return Text(value, justify="left" if col.text else "right")


def default_reverse(column: str | None) -> bool:
    """A sort's first direction: numbers largest first; names, states, service order as they go."""
    return column not in (None, "id", "state")


def sort_lines(rows: Sequence[RequestRow], column: str | None, reverse: bool) -> list[Line]:
    """The table's lines in the daemon's service order (``column`` None) or sorted by a
    column; a request's sequences stay together under their group line."""
    return lines(rows, None if column is None else _BY_KEY[column].sort, reverse)


def _texts(line: Line) -> list[str]:
    return [line.label if col.key == "id" else col.cell(line.row) for col in COLUMNS]


class RequestsTable(DataTable):
    """A ``DataTable`` of request lines (``request_groups.Line``: a sequence, or a group and
    its members) keyed by seq id or group key; the cursor follows its line. Enter on a line
    posts ``RowSelected`` (the app opens the request's detail view)."""

    BINDINGS = [
        Binding("enter", "select_cursor", "Detail", id="pagectl.requests.detail"),
        Binding("s", "cycle_sort", "Sort", id="pagectl.requests.sort"),
        Binding("S", "reverse_sort", "Reverse", show=False, id="pagectl.requests.reverse"),
    ]

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes, cursor_type="row", zebra_stripes=True)
        # Column key sorted on (None: service order) and direction.
        self.sort_column: str | None = None
        self.sort_reverse = False
        self.rows_by_id: dict[str, RequestRow] = {}
        self.lines_by_key: dict[str, Line] = {}
        # The texts of the cells shown, per row key, in COLUMNS order.
        self._texts: dict[str, list[str]] = {}
        self._order: list[str] = []
        self._raw: list[RequestRow] = []

    def on_mount(self) -> None:
        for col in COLUMNS:
            # The state column is sized for its longest value ("preempted").
            self.add_column(col.label, key=col.key, width=9 if col.key == "state" else None)

    @property
    def selected_line(self) -> Line | None:
        """The line under the cursor."""
        if not self._order or not 0 <= self.cursor_row < len(self._order):
            return None
        return self.lines_by_key.get(self._order[self.cursor_row])

    @property
    def selected(self) -> RequestRow | None:
        """The row under the cursor (a group's aggregate row on a group line)."""
        line = self.selected_line
        return line.row if line is not None else None

    def show_rows(self, rows: Sequence[RequestRow]) -> None:
        self._raw = list(rows)
        ordered = sort_lines(rows, self.sort_column, self.sort_reverse)
        keys = [line.key for line in ordered]
        self.lines_by_key = dict(zip(keys, ordered, strict=True))
        self.rows_by_id = {key: line.row for key, line in self.lines_by_key.items()}
        # Each cell is formatted once per snapshot and compared with the text shown.
        shown = self._texts
        texts = {key: _texts(line) for key, line in self.lines_by_key.items()}
        self._texts = texts
        if keys == self._order:
            for key, line in zip(keys, ordered, strict=True):
                before = shown.get(key)
                for i, (col, text) in enumerate(zip(COLUMNS, texts[key], strict=True)):
                    if before is None or before[i] != text:
                        self.update_cell(key, col.key, _cell(col, line.row, text, line.kind))
        else:
            current = self.selected_line
            self.clear()
            for key, line in zip(keys, ordered, strict=True):
                cells = (
                    _cell(col, line.row, text, line.kind)
                    for col, text in zip(COLUMNS, texts[key], strict=True)
                )
                self.add_row(*cells, key=key)
            self._order = keys
            if current is not None and current.key in self.lines_by_key:
                self.move_cursor(row=keys.index(current.key), animate=False)
        self._update_title()

    def _update_title(self) -> None:
        states = [r.state for r in self._raw]
        running = states.count("running")
        waiting = len(states) - running
        order = (
            "service order" if self.sort_column is None else f"by {_BY_KEY[self.sort_column].label}"
        )
        arrow = " ↓" if self.sort_reverse else ""
        self.border_title = f"Requests · {running} running · {waiting} waiting · {order}{arrow}"

    def sort_by(self, column: str | None, reverse: bool = False) -> None:
        self.sort_column = column
        self.sort_reverse = reverse
        self._order = []  # force a rebuild in the new order
        self.show_rows(self._raw)

    def action_cycle_sort(self) -> None:
        keys: list[str | None] = [None, *COLUMN_KEYS]
        nxt = keys[(keys.index(self.sort_column) + 1) % len(keys)]
        self.sort_by(nxt, default_reverse(nxt))

    def action_reverse_sort(self) -> None:
        self.sort_by(self.sort_column, not self.sort_reverse)

    def sort_or_reverse(self, column: str | None) -> None:
        """Sort by ``column``, or reverse the order when the rows are sorted by it already."""
        if column is not None and column == self.sort_column:
            self.sort_by(column, not self.sort_reverse)
        else:
            self.sort_by(column, default_reverse(column))

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        self.sort_or_reverse(str(event.column_key.value))
