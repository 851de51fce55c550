"""Where pagectl's time goes during a benchmark run.

``PhaseTimer`` wraps, on one ``LLM`` instance only, the three calls each engine step makes —
``scheduler.schedule``, ``executor.execute_model`` (batch preparation, forward, sampling) and
``scheduler.update_from_output`` — and adds up their wall time. What remains of the run is
the offline loop itself (output bookkeeping, detokenization). ``top_functions`` summarises a
cProfile run by own time, which splits the executor's share into torch operations.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from typing import Any

from pagectl.bench.report import format_table

_PHASES = (
    ("schedule", "scheduler", "schedule"),
    ("execute_model", "executor", "execute_model"),
    ("update_from_output", "scheduler", "update_from_output"),
)


class PhaseTimer:
    """Accumulates wall time per engine-step phase while installed on ``llm.core``."""

    def __init__(self, llm: Any) -> None:
        self.core = llm.core
        self.totals = {name: 0.0 for name, _, _ in _PHASES}
        self.calls = {name: 0 for name, _, _ in _PHASES}
        self._saved: list[Any] = []

    def __enter__(self) -> PhaseTimer:
        for name, owner_attr, method in _PHASES:
            owner = getattr(self.core, owner_attr)
            self._saved.append(_patch(owner, method, self._timed(name, getattr(owner, method))))
        return self

    def __exit__(self, *exc: object) -> None:
        for restore in reversed(self._saved):
            restore()
        self._saved.clear()

    def _timed(self, name: str, fn: Any) -> Any:
        totals, calls, clock = self.totals, self.calls, time.perf_counter

        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = clock()
            try:
                return fn(*a, **kw)
            finally:
                totals[name] += clock() - t0
                calls[name] += 1

        return wrapper

    def breakdown(self, elapsed_s: float) -> dict[str, float]:
        """Seconds per phase, plus "offline loop" for the rest of ``elapsed_s``."""
        out = dict(self.totals)
        out["offline loop (outputs, detokenization)"] = max(
            0.0, elapsed_s - sum(self.totals.values())
        )
        return out


class ModelTokenCounter:
    """Counts the tokens fed to the model (every step's scheduled tokens) on ``llm.core``.

    Prompt tokens computed plus decode inputs, recomputation after preemption included:
    what the forward passes actually processed. One Python call per step of overhead.
    """

    def __init__(self, llm: Any) -> None:
        self.executor = llm.core.executor
        self.tokens = 0
        self.steps = 0

    def __enter__(self) -> ModelTokenCounter:
        inner = self.executor.execute_model

        def execute_model(so: Any) -> Any:
            self.tokens += so.total_num_scheduled_tokens
            self.steps += 1
            return inner(so)

        self._restore = _patch(self.executor, "execute_model", execute_model)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()


def _patch(owner: Any, name: str, value: Any) -> Any:
    """Set ``owner.name = value`` on the instance; returns a function that undoes it."""
    missing = object()
    previous = vars(owner).get(name, missing)
    setattr(owner, name, value)

    def restore() -> None:
        if previous is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, previous)

    return restore


def render_breakdown(breakdown: dict[str, float], steps: int) -> str:
    total = sum(breakdown.values()) or 1.0
    rows = [
        [name, secs, f"{100 * secs / total:.1f}%", 1000 * secs / steps if steps else None]
        for name, secs in breakdown.items()
    ]
    return format_table(["phase", "seconds", "share", "ms per step"], rows)


def top_functions(profile: cProfile.Profile, n: int = 20) -> str:
    """The ``n`` functions with the most own time (torch operations show up by name)."""
    buf = io.StringIO()
    pstats.Stats(profile, stream=buf).sort_stats("tottime").print_stats(n)
    lines = buf.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return "\n".join(line for line in lines[start:] if line.strip())
