"""One telemetry snapshot for scripts (``pagectl top --once [--json]``) and a line a second
for shells (``pagectl ctl watch``), read from a daemon's telemetry socket."""

from __future__ import annotations

import json
import sys
import time

import msgspec

from pagectl.control.protocol import RuntimeInfo
from pagectl.engine.telemetry import TelemetrySnapshot


def snapshot_json(snap: TelemetrySnapshot, info: RuntimeInfo | None) -> str:
    """The snapshot as JSON (block arrays and block tables as base64, as msgspec writes
    bytes), with the daemon's ``http_url`` and ``pid`` under ``daemon`` when known."""
    obj = msgspec.to_builtins(snap)
    if info is not None:
        obj["daemon"] = {"pid": info.pid, "http_url": info.http_url, "model": info.model}
    return json.dumps(obj, sort_keys=True)


def snapshot_text(snap: TelemetrySnapshot, info: RuntimeInfo | None) -> str:
    from pagectl.tui.connection import LIVE, Connection
    from pagectl.tui.widgets.gauges import render_gauges
    from pagectl.tui.widgets.header import render_header

    link = Connection(LIVE, info.http_url if info else "", max(0.0, time.time() - snap.time))
    return render_header(snap, link).plain + "\n" + render_gauges(snap, 30).plain


def recv_one(endpoint: str, timeout: float, token: str | None = None) -> TelemetrySnapshot | None:
    """One snapshot (``token``: presented to telemetry that asks for it)."""
    from pagectl.control.client import TelemetrySubscriber

    with TelemetrySubscriber(endpoint, token=token) as sub:
        return sub.recv(timeout=timeout)


class WatchLine:
    """Folds successive snapshots into one line each: running, waiting, KV%, generated
    tok/s, prefix hit rate and preemptions over the interval."""

    HEADER = (
        f"{'time':<8} {'running':>7} {'waiting':>7} {'kv%':>5} {'tok/s':>8} {'hit%':>5} "
        f"{'preempt':>7}"
    )

    def __init__(self) -> None:
        self.prev: TelemetrySnapshot | None = None

    def line(self, snap: TelemetrySnapshot) -> str:
        p = self.prev
        self.prev = snap
        c = snap.counters
        kv = snap.num_used_blocks / max(1, snap.blocks.num_blocks)
        if p is None or p.start_time != snap.start_time or snap.time <= p.time:
            tps, hit, pre = "-", "-", "-"
        else:
            dt = snap.time - p.time
            tps = f"{(c.generation_tokens - p.counters.generation_tokens) / dt:.0f}"
            dq = c.prefix_queries - p.counters.prefix_queries
            hit = f"{(c.prefix_hits - p.counters.prefix_hits) / dq:.0%}" if dq > 0 else "-"
            pre = str(c.preemptions - p.counters.preemptions)
        when = time.strftime("%H:%M:%S", time.localtime(snap.time))
        return (
            f"{when:<8} {snap.num_running:>7} {snap.num_waiting:>7} {kv:>5.0%} {tps:>8} "
            f"{hit:>5} {pre:>7}"
        )


def watch(
    endpoint: str, interval: float, count: int, timeout: float, token: str | None = None
) -> int:
    """Print ``WatchLine`` lines every ``interval`` s (``count`` lines; 0: until Ctrl-C)."""
    from pagectl.control.client import TelemetrySubscriber

    w = WatchLine()
    printed = 0
    print(WatchLine.HEADER, flush=True)
    with TelemetrySubscriber(endpoint, token=token) as sub:
        try:
            while count <= 0 or printed < count:
                snap = sub.recv(timeout=max(timeout, interval))
                if snap is None:
                    print(f"pagectl ctl: no telemetry for {timeout:g}s", file=sys.stderr)
                    return 3
                if w.prev is not None and snap.time - w.prev.time < interval * 0.9:
                    continue
                print(w.line(snap), flush=True)
                printed += 1
        except KeyboardInterrupt:
            return 0
    return 0
