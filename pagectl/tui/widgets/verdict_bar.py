"""The verdict line under the header: what the last minute says to change (hidden when all
is well). The rules are ``pagectl.control.verdicts``."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import Static

from pagectl.control.verdicts import Verdict


def render_verdicts(found: Sequence[Verdict]) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    for i, v in enumerate(found):
        if i:
            t.append("\n")
        t.append(" ▲ ", style="bold #0d1117 on #d8a32b")
        t.append(f" {v.message}", style="#d8a32b")
    return t


class VerdictBar(Static):
    def show(self, found: Sequence[Verdict]) -> None:
        self.display = bool(found)
        self.update(render_verdicts(found))
