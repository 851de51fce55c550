"""Choosing a daemon when several run and ``pagectl top`` was given no selector."""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from pagectl.control.protocol import RuntimeInfo
from pagectl.tui import fmt


def describe(info: RuntimeInfo, now: float) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(f"{info.http_url:<26}", style="bold")
    t.append(f" {info.model}", style="#c9d1d9")
    t.append(
        f"  pid {info.pid} · TP {info.tp_size} · up {fmt.duration(now - info.start_time)}",
        style="#8b949e",
    )
    return t


class DaemonPicker(ModalScreen[RuntimeInfo | None]):
    """Lists the daemons; enter attaches to the highlighted one, escape quits the console."""

    BINDINGS = [Binding("escape,q", "cancel", "Quit", id="pagectl.picker.cancel")]

    def __init__(self, choices: list[RuntimeInfo], runtime_dir: str = "") -> None:
        super().__init__(classes="dialog-screen")
        self.choices = choices
        self.runtime_dir = runtime_dir

    def compose(self) -> ComposeResult:
        now = time.time()
        with Vertical(classes="dialog picker"):
            yield Label(
                f"{len(self.choices)} daemons are running: attach to", classes="dialog-title"
            )
            yield OptionList(
                *(Option(describe(i, now), id=str(i.pid)) for i in self.choices), id="choices"
            )
            where = f" in {self.runtime_dir}" if self.runtime_dir else ""
            yield Label(
                f"enter attaches · escape quits · `pagectl top --url/--port/--pid` skips "
                f"this{where}",
                classes="dialog-detail",
            )

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        pid = int(event.option.id or 0)
        self.dismiss(next(i for i in self.choices if i.pid == pid))

    def action_cancel(self) -> None:
        self.dismiss(None)
