"""Ask for an exact integer value of a live setting (from the command palette)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.validation import Integer
from textual.widgets import Input, Label


class ValuePrompt(ModalScreen[int | None]):
    """Dismisses with the value entered, or None on escape."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="pagectl.prompt.cancel")]

    def __init__(
        self, title: str, current: int, low: int, high: int | None, help: str = ""
    ) -> None:
        super().__init__(classes="dialog-screen")
        self.title_text = title
        self.current = current
        self.low = low
        self.high = high

        self.help = help

    def compose(self) -> ComposeResult:
        bounds = f"{self.low}…{self.high}" if self.high is not None else f">= {self.low}"
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="dialog-title")
            if self.help:
                yield Label(self.help, classes="dialog-detail")
            yield Label(
                f"now {self.current}; allowed {bounds}. Enter sends, escape cancels.",
                classes="dialog-detail",
            )
            yield Input(
                str(self.current),
                type="integer",
                validators=[Integer(minimum=self.low, maximum=self.high)],
                id="value",
            )

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.validation_result is not None and not event.validation_result.is_valid:
            self.notify("; ".join(event.validation_result.failure_descriptions), severity="error")
            return
        self.dismiss(int(event.value))

    def action_cancel(self) -> None:
        self.dismiss(None)
