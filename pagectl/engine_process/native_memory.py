"""Native-memory bounds of the engine process, set before torch is imported.

The engine's Python heap stays flat over a long run while its RSS grows: what grows is
native memory held by caches keyed by tensor shape, and every new batch shape (the number
of tokens in a step changes all the time) adds entries. ``configure()`` bounds them; it
must run before ``import torch`` (the libraries read their settings once, at load), so the
engine process calls it first thing in its entry point. docs/PERFORMANCE.md section 10 has
the measurements behind each value.

Every setting is a default: a variable already in the environment is left as it is, so an
operator can still choose another value (or ``PAGECTL_NATIVE_MEMORY=0`` leaves everything
alone).

``IdleTrim`` hands freed heap pages back to the system (glibc ``malloc_trim``) once the
engine has been idle for a while: never on the hot path, never twice in one idle period.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger("pagectl.native_memory")

# Environment defaults (the operator's environment wins).
ENV_DEFAULTS: dict[str, str] = {
    # oneDNN keeps a compiled primitive (JIT code and scratch) per shape, 1024 by default;
    # steps of varying token counts fill it with entries that are rarely used again.
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64",
    # torch's ideep layer keeps its own LRU of the same primitives (1024 by default): both
    # must be bounded, as an entry's memory is freed only once neither cache holds it.
    "LRU_CACHE_CAPACITY": "64",
}
# Seconds idle before ``IdleTrim`` trims (long enough that a pause between two bursts of
# requests does not pay for it; the trim itself takes milliseconds).
IDLE_TRIM_AFTER_S = 2.0

_libc: ctypes.CDLL | None = None


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (malloc_trim exists), else None."""
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            lib.malloc_trim  # noqa: B018  (AttributeError on musl and others)
        except (OSError, AttributeError):
            return None
        _libc = lib
    return _libc


def enabled() -> bool:
    return os.environ.get("PAGECTL_NATIVE_MEMORY", "1") != "0"


def configure() -> dict[str, str]:
    """Apply the environment defaults (before torch is imported); returns what was set."""
    if not enabled():
        return {}
    applied = {}
    for name, value in ENV_DEFAULTS.items():
        if name not in os.environ:
            os.environ[name] = value
            applied[name] = value
    return applied


def malloc_trim() -> bool:
    """Return the free memory at the top of glibc's heaps to the system; False without glibc."""
    lib = _glibc()
    if lib is None:
        return False
    lib.malloc_trim(0)
    return True


class IdleTrim:
    """Calls ``trim`` once per idle period, after ``after_s`` seconds without a step.

    The engine loop calls ``busy()`` after every step and ``idle()`` when it has nothing to
    run (its idle poll wakes at least every 0.1 s); the trim happens in ``idle`` only, so it
    never delays a step that was ready.
    """

    def __init__(
        self,
        after_s: float = IDLE_TRIM_AFTER_S,
        trim: Callable[[], bool] = malloc_trim,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.after_s = after_s
        self._trim = trim
        self._clock = clock
        # monotonic time of the last step; None once trimmed (until the next step).
        self._last_busy: float | None = None
        self.trims = 0
        self.last_trim_s = 0.0  # how long the last trim took

    def busy(self) -> None:
        self._last_busy = self._clock()

    def idle(self) -> None:
        if self._last_busy is None or self._clock() - self._last_busy < self.after_s:
            return
        self._last_busy = None
        t0 = time.perf_counter()
        if self._trim():
            self.trims += 1
            self.last_trim_s = time.perf_counter() - t0
