"""The help screen: keys, the map's legend, and where figures come from."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from pagectl.tui.widgets.legend import render_legend

KEYS = (
    ("p", "toggle prefix caching (off releases cached-but-unused blocks)"),
    ("] / [", "raise / lower the token budget (max_num_batched_tokens) by 25%"),
    ("} / {", "raise / lower the running cap (max_num_seqs) by 25%"),
    ("ctrl+p", "command palette: exact values, every command, sorting"),
    ("r", "reset the prefix cache (asks first)"),
    ("space", "pause / resume admission (replay: pause / resume playback)"),
    ("k", "abort the request highlighted in the table (asks first)"),
    ("> / <", "replay: play faster / slower"),
    ("tab", "move between the map and the requests table"),
    ("arrows, click", "map: select a cell; table: highlight a request (its blocks light up)"),
    ("enter", "map: ask the daemon about the selected block; table: the request's detail"),
    ("i", "inspected block, request detail: tokens as ids / as text"),
    ("escape", "request detail: back to the console"),
    ("+ / - / 0", "map: zoom in / out / fit the whole pool"),
    ("s / S", "table: next sort column / reverse"),
    ("e", "events: show all / config / preemption / cache / admission"),
    ("v", "small terminals: show Over time, then Selection, then events again"),
    ("n / N, 1-9", "fleet: show the next / previous member, or member 1-9"),
    ("?", "this help"),
    ("q", "quit"),
)

NOTES = """\
Keys that cannot work right now are greyed out in the footer: when the daemon is
unreachable, when there is no control token (read-only), and during a replay.
Every command shows the daemon's answer (accepted with old -> new, or its error).

Gauges: KV blocks counts blocks with refcount > 0; KV tokens counts the token slots
holding live tokens in them. Their difference is fragmentation (empty slots in the
last, partial block of each sequence). Cached blocks are free but hold a reusable
prefix; they are evicted (LRU) when the pool needs them.

Rates come from counter deltas on the engine's clock; prefix hit rate counts tokens
(rolling window and since start); re-prefill after a preemption is not a hit.

The header turns red (DISCONNECTED) when no telemetry arrived for a few seconds:
the picture is kept, marked stale, and the console reconnects by itself."""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "Close", id="pagectl.help.close")]

    def __init__(self, diagnostics: str = "") -> None:
        super().__init__(classes="dialog-screen")
        self.diagnostics = diagnostics

    def compose(self) -> ComposeResult:
        keys = Text()
        for key, what in KEYS:
            keys.append(f"{key:>14}  ", style="bold #58a6ff")
            keys.append(f"{what}\n")
        with VerticalScroll(classes="dialog help"):
            yield Static("pagectl top — keys", classes="dialog-title")
            yield Static(keys)
            yield Static("Block map legend", classes="dialog-title")
            yield Static(render_legend(10))
            yield Static(NOTES, classes="dialog-detail")
            if self.diagnostics:
                yield Static(self.diagnostics, classes="dialog-detail")
