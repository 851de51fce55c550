"""The request detail screen: one request (or one of its sequences), opened with enter on a
line of the requests table.

The facts follow every snapshot (``show_rows``, called by the app); the tokens come from the
daemon's ``inspect_request`` when the screen opens and again, at most once a second, while
the request's output grows (``request_detail.fetch_tokens``: decoded in a worker thread).
A full screen, so it has the whole terminal at 80x24; escape goes back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from pagectl.engine.commands import CommandError
from pagectl.engine.telemetry import RequestRow
from pagectl.tui.request_detail import Target, fetch_tokens, render_facts, render_tokens

# Ids asked for per token list (the engine caps it at inspect.MAX_INSPECT_TOKENS).
FETCH_TOKENS = 1024
# Seconds between two refreshes of the tokens while the output grows.
REFRESH_S = 1.0


class RequestDetailScreen(Screen[None]):
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back", id="pagectl.detail.back"),
        Binding("i", "toggle_ids", "Ids/text", id="pagectl.detail.ids"),
    ]

    def __init__(
        self,
        target: Target,
        source: Any,
        detokenizer: Any,
        rows: Sequence[RequestRow],
        *,
        can_fetch: Callable[[], bool],
        read_only_reason: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(classes="request-detail")
        self.target = target
        self.source = source
        self.detokenizer = detokenizer
        self.can_fetch = can_fetch
        self.read_only_reason = read_only_reason
        self.clock = clock
        self.members = target.members(rows)
        # The rows last seen, kept when the request leaves the telemetry.
        self.gone = False
        self.show_ids = False
        # The daemon's last answer, and "pending", "ok" or why the last fetch failed.
        self.tokens: dict | None = None
        self.status = "pending"
        self._fetching = False
        self._fetched_at: float | None = None
        self._fetched_output = -1
        self.facts_panel = Static(id="detail-facts")
        self.tokens_panel = Static(id="detail-text")
        self.tokens_scroll = VerticalScroll(id="detail-scroll")

    def compose(self) -> ComposeResult:
        yield self.facts_panel
        with self.tokens_scroll:
            yield self.tokens_panel
        yield Footer()

    def on_mount(self) -> None:
        self.facts_panel.border_title = self.target.title
        self.tokens_scroll.border_title = "Tokens"
        self.tokens_scroll.border_subtitle = "i: ids/text · escape: back"
        self._redraw()
        self._maybe_fetch()

    # -- updates ------------------------------------------------------------------------

    def show_rows(self, rows: Sequence[RequestRow]) -> None:
        """A new snapshot: the target's rows (kept as they were once it is gone)."""
        members = self.target.members(rows)
        if members:
            self.members, self.gone = members, False
        else:
            self.gone = True
        self._redraw()
        self._maybe_fetch()

    def _output(self) -> int:
        return sum(m.num_output_tokens for m in self.members)

    def _maybe_fetch(self) -> None:
        if self._fetching or not self.can_fetch() or (self.gone and self.tokens is not None):
            return
        now = self.clock()
        if self._fetched_at is not None and (
            self._output() == self._fetched_output or now - self._fetched_at < REFRESH_S
        ):
            return
        self._fetching = True
        self._fetched_at = now
        self._fetched_output = self._output()
        self._fetch()

    @work(exclusive=True, group="request-tokens")
    async def _fetch(self) -> None:
        try:
            self.tokens = await fetch_tokens(
                self.source, self.detokenizer, self.target, FETCH_TOKENS
            )
            self.status = "ok"
        except CommandError as e:
            self.status = f"{e.kind}: {e.message}"
        finally:
            self._fetching = False
        self._redraw()

    def _redraw(self) -> None:
        self.facts_panel.update(render_facts(self.target, self.members, self.gone))
        self.tokens_panel.update(
            render_tokens(
                self.tokens, self.status, self.show_ids, self.can_fetch(), self.read_only_reason
            )
        )

    def action_toggle_ids(self) -> None:
        self.show_ids = not self.show_ids
        self._redraw()


__all__ = ["FETCH_TOKENS", "RequestDetailScreen"]
