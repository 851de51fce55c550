"""Command palette provider: every console command, plus exact values for live settings.

Typing a setting and a number (``budget 4096``, ``max_num_seqs 12``) offers to set exactly
that value; choosing "Set … " without a number opens a prompt.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from textual.command import DiscoveryHit, Hit, Hits, Provider

from pagectl.tui.knobs import KNOBS, Knob
from pagectl.tui.widgets.requests_table import COLUMNS

if TYPE_CHECKING:
    from pagectl.tui.app import PagectlTop

_VALUE_QUERY = re.compile(r"^\s*(?:set\s+)?([a-z_\- ]+?)\s*[= ]\s*(\d[\d_]*)\s*$", re.I)


def _knob_matches(knob: Knob, words: str) -> bool:
    w = words.lower().replace("-", "_").replace(" ", "_").strip("_")
    return bool(w) and (w in knob.name or w in knob.label.replace(" ", "_"))


class ConsoleCommands(Provider):
    """Commands of ``PagectlTop``; control commands only when they can work."""

    @property
    def console(self) -> PagectlTop:
        return self.app  # type: ignore[return-value]

    def _commands(self) -> list[tuple[str, Callable[[], object], str]]:
        app = self.console
        out: list[tuple[str, Callable[[], object], str]] = []
        if app.control_ready:
            cfg = app.config
            on = bool(cfg.get("enable_prefix_caching", True))
            for knob in KNOBS:
                out.append(
                    (
                        f"Set {knob.name}…",
                        partial(app.prompt_knob, knob),
                        f"{knob.help}; now {cfg.get(knob.name, '?')}",
                    )
                )
            out.append(
                (
                    "Turn prefix caching off" if on else "Turn prefix caching on",
                    app.action_toggle_prefix_caching,
                    "off releases cached-but-unused blocks; running requests are untouched",
                )
            )
            out.append(("Reset the prefix cache…", app.action_reset_prefix_cache, "asks first"))
            out.append(
                (
                    "Resume admission" if app.admission_paused else "Pause admission",
                    app.action_pause,
                    "waiting requests stay queued while paused; running ones go on",
                )
            )
            row = app.selected_request
            if row is not None:
                out.append(
                    (
                        f"Abort request {row.request_id}…",
                        app.action_abort,
                        "all its samples; asks first",
                    )
                )
        for col in COLUMNS:
            out.append(
                (
                    f"Sort requests by {col.label}",
                    partial(app.sort_requests, col.key),
                    "again to reverse",
                )
            )
        out.append(("Sort requests in service order", partial(app.sort_requests, None), ""))
        out.append(("Block map: fit the whole pool", app.map_fit, "0 on the map"))
        out.append(("Help: keys and legend", app.action_help, "?"))
        return out

    async def discover(self) -> Hits:
        for name, callback, help_text in self._commands():
            yield DiscoveryHit(name, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        app = self.console
        m = _VALUE_QUERY.match(query)
        if m and app.control_ready:
            value = int(m.group(2).replace("_", ""))
            for knob in KNOBS:
                if _knob_matches(knob, m.group(1)):
                    yield Hit(
                        1.0,
                        f"Set {knob.name} = {value}",
                        partial(app.set_knob, knob, value),
                        help=knob.help,
                    )
        matcher = self.matcher(query)
        for name, callback, help_text in self._commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), callback, help=help_text)
