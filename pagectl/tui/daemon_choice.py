"""Which daemon ``pagectl top`` attaches to: a selector (``--url/--port/--pid``) resolved
against the runtime directory at every (re)connection, or the operator's pick."""

from __future__ import annotations

from pagectl.control.protocol import RuntimeInfo
from pagectl.control.runtime import live_runtimes
from pagectl.control.selection import Selector, select_runtime
from pagectl.tui.zmq_source import Endpoints


class SelectingResolver:
    """A ``zmq_source.Resolver``: the endpoints of the daemon ``selector`` names.

    With several daemons and an empty selector it raises ``AmbiguousRuntime`` (its message
    lands in the header) until ``choose`` pins one. A choice is pinned by HTTP URL, so a
    daemon restarted on the same port is found again.
    """

    def __init__(self, runtime_dir: str | None, selector: Selector | None = None) -> None:
        self.runtime_dir = runtime_dir
        self.selector = selector or Selector()
        # The runtime file of the daemon found last (None: none yet).
        self.info: RuntimeInfo | None = None

    def __call__(self) -> Endpoints:
        info = select_runtime(self.runtime_dir, self.selector)
        self.info = info
        return Endpoints(
            info.telemetry_endpoint,
            info.control_endpoint,
            info.token_file,
            info.http_url,
            telemetry_auth=info.telemetry_auth,
        )

    def choices(self) -> list[RuntimeInfo]:
        """The daemons to pick from: several and no selector; else [] (nothing to ask)."""
        if not self.selector.empty:
            return []
        live = live_runtimes(self.runtime_dir)
        return live if len(live) > 1 else []

    def choose(self, info: RuntimeInfo) -> None:
        self.selector = Selector(url=info.http_url)
