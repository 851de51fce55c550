"""Time series behind the sparklines, folded from successive telemetry snapshots.

Rates come from counter deltas between samples taken at least ``interval`` seconds apart on
the engine's clock (``snapshot.time``), so they do not depend on how often frames arrive.
Per-step figures come from the snapshot's step stats, deduplicated by ``step_id``. A daemon
restart (new ``start_time``, or counters going backwards) starts the history afresh.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagectl.engine.telemetry import TelemetrySnapshot


@dataclass(frozen=True)
class Sample:
    """One point of every per-time series."""

    time: float
    prompt_tps: float
    generation_tps: float
    # Prefix-cache hit rate over the rolling window (None: no lookups in the window).
    hit_rate: float | None
    # Preemptions during the interval.
    preemptions: int
    running: int
    waiting: int


@dataclass(frozen=True)
class StepPoint:
    step_id: int
    num_scheduled_tokens: int
    token_budget: int


class History:
    def __init__(self, *, interval: float = 1.0, window_s: float = 60.0, maxlen: int = 600) -> None:
        self.interval = interval
        self.window_s = window_s
        self.samples: deque[Sample] = deque(maxlen=maxlen)
        self.steps: deque[StepPoint] = deque(maxlen=maxlen)
        self._start_time: float | None = None
        self._last_step_id = 0
        # The previous sample's (time, prompt_tokens, generation_tokens, preemptions): the rates'
        # base. The hit-rate window keeps its own (time, prefix_hits, prefix_queries) marks.
        self._base: tuple[float, int, int, int] | None = None
        self._marks: deque[tuple[float, int, int]] = deque()
        self.hit_rate_total: float | None = None

    def reset(self) -> None:
        self.samples.clear()
        self.steps.clear()
        self._marks.clear()
        self._base = None
        self._last_step_id = 0
        self.hit_rate_total = None

    def update(self, snap: TelemetrySnapshot) -> None:
        c = snap.counters
        if self._start_time != snap.start_time or (
            self._base is not None and c.prompt_tokens < self._base[1]
        ):
            self.reset()
            self._start_time = snap.start_time
        for s in snap.steps:
            if s.step_id > self._last_step_id:
                self.steps.append(StepPoint(s.step_id, s.num_scheduled_tokens, s.token_budget))
                self._last_step_id = s.step_id
        self.hit_rate_total = c.prefix_hits / c.prefix_queries if c.prefix_queries else None
        now = snap.time
        point = (now, c.prompt_tokens, c.generation_tokens, c.preemptions)
        b = self._base
        if b is not None and now - b[0] < self.interval:
            return
        self._base = point
        self._marks.append((now, c.prefix_hits, c.prefix_queries))
        if b is None:
            return  # the first point: no interval to take rates over yet
        dt = now - b[0]
        while len(self._marks) > 1 and self._marks[1][0] <= now - self.window_s:
            self._marks.popleft()
        _, h0, q0 = self._marks[0]
        dq = c.prefix_queries - q0
        self.samples.append(
            Sample(
                time=now,
                prompt_tps=(c.prompt_tokens - b[1]) / dt,
                generation_tps=(c.generation_tokens - b[2]) / dt,
                hit_rate=(c.prefix_hits - h0) / dq if dq > 0 else None,
                preemptions=c.preemptions - b[3],
                running=snap.num_running,
                waiting=snap.num_waiting,
            )
        )

    @property
    def hit_rate_window(self) -> float | None:
        return self.samples[-1].hit_rate if self.samples else None
