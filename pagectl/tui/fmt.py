"""Number and time formatting shared by the panels."""

from __future__ import annotations

import time


def count(n: float) -> str:
    """1234567 -> "1,234,567"."""
    return f"{int(n):,}"


def si(n: float) -> str:
    """A compact count: 950, 12.3k, 4.56M."""
    n = float(n)
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            v = n / div
            return f"{v:.3g}{unit}" if v < 100 else f"{v:.0f}{unit}"
    return f"{n:.0f}" if n == int(n) or abs(n) >= 10 else f"{n:.1f}"


def size(nbytes: float) -> str:
    """Bytes in binary units: "512 B", "1.5 KiB", "64.0 GiB"."""
    n = float(nbytes)
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"


def duration(seconds: float) -> str:
    """A short duration: "0.4s", "12s", "5m03s", "2h07m", "3d04h"."""
    s = max(0.0, seconds)
    if s < 10:
        return f"{s:.1f}s"
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def clock_time(t: float) -> str:
    """Wall-clock time of day (local time zone), HH:MM:SS."""
    return time.strftime("%H:%M:%S", time.localtime(t))
