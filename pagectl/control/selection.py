"""Choosing one daemon among those in a runtime directory: ``--url``, ``--port``, ``--pid``.

``select_runtime`` never guesses: with several live daemons and no selector it raises
``AmbiguousRuntime`` carrying the list, so ``pagectl ctl`` can refuse with it and
``pagectl top`` can offer a picker. ``describe_runtimes`` is the table ``pagectl ls`` prints.
"""

from __future__ import annotations

import os
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pagectl.control.protocol import RuntimeInfo
from pagectl.control.runtime import (
    RuntimeNotFound,
    default_runtime_dir,
    live_runtimes,
    no_daemon_message,
)

# Hosts that name this machine: a daemon bound to one of them answers on any other.
_LOCAL_HOSTS = frozenset({"", "localhost", "127.0.0.1", "::1", "0.0.0.0", "::"})


class AmbiguousRuntime(RuntimeNotFound):
    """Several live daemons and no selector. ``candidates`` lists them, oldest first."""

    def __init__(self, message: str, candidates: list[RuntimeInfo]) -> None:
        super().__init__(message)
        self.candidates = candidates


@dataclass(frozen=True)
class Selector:
    """Which daemon to attach to; every field None means "the only one"."""

    # The daemon's HTTP address, e.g. "http://127.0.0.1:8000" (scheme optional).
    url: str | None = None
    # The daemon's HTTP port.
    port: int | None = None
    # The daemon's process id (the API server's, as `pagectl ls` shows it).
    pid: int | None = None

    @property
    def empty(self) -> bool:
        return self.url is None and self.port is None and self.pid is None

    def describe(self) -> str:
        parts = []
        if self.url is not None:
            parts.append(f"--url {self.url}")
        if self.port is not None:
            parts.append(f"--port {self.port}")
        if self.pid is not None:
            parts.append(f"--pid {self.pid}")
        return " ".join(parts)


def _host_port(url: str) -> tuple[str, int | None]:
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    return (parts.hostname or "").lower(), port


def url_matches(wanted: str, recorded: str) -> bool:
    """Whether the HTTP address ``wanted`` reaches the daemon that recorded ``recorded``.

    Ports must be equal; hosts too, unless either is a name of this machine (a daemon on
    0.0.0.0 is reached at 127.0.0.1).
    """
    wh, wp = _host_port(wanted)
    rh, rp = _host_port(recorded)
    if wp != rp:
        return False
    return wh == rh or wh in _LOCAL_HOSTS or rh in _LOCAL_HOSTS


def matches(info: RuntimeInfo, sel: Selector) -> bool:
    if sel.pid is not None and info.pid != sel.pid:
        return False
    if sel.port is not None and _host_port(info.http_url)[1] != sel.port:
        return False
    return sel.url is None or url_matches(sel.url, info.http_url)


def select_runtime(
    runtime_dir: str | os.PathLike | None = None, selector: Selector | None = None
) -> RuntimeInfo:
    """The one live daemon ``selector`` names (or the only one, with no selector).

    Raises:
        RuntimeNotFound: no live daemon, or none matches the selector.
        AmbiguousRuntime: several match (several daemons and no selector, or a selector
            that names several).
    """
    sel = selector or Selector()
    base = Path(runtime_dir).expanduser() if runtime_dir else default_runtime_dir()
    live = live_runtimes(base)
    if not live:
        raise RuntimeNotFound(no_daemon_message(base))
    chosen = [i for i in live if matches(i, sel)]
    if not chosen:
        raise RuntimeNotFound(
            f"no running daemon in {base} matches {sel.describe()}; running:\n"
            + describe_runtimes(live)
        )
    if len(chosen) > 1:
        how = "no daemon chosen" if sel.empty else f"{sel.describe()} matches several"
        raise AmbiguousRuntime(
            f"{len(chosen)} daemons run in {base} and {how}: pick one with --url, --port "
            "or --pid (see `pagectl ls`):\n" + describe_runtimes(chosen),
            chosen,
        )
    return chosen[0]


def describe_runtimes(
    infos: Sequence[RuntimeInfo],
    states: Sequence[str] | None = None,
    now: float | None = None,
) -> str:
    """A table of daemons: pid, model, HTTP URL, TP, uptime (and state when given)."""
    from pagectl.tui.fmt import duration

    now = time.time() if now is None else now
    rows = [("PID", "MODEL", "HTTP URL", "TP", "UPTIME") + (("STATE",) if states else ())]
    for k, i in enumerate(infos):
        row = (
            str(i.pid),
            i.model,
            i.http_url,
            str(i.tp_size),
            duration(max(0.0, now - i.start_time)),
        )
        rows.append(row + ((states[k],) if states else ()))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
