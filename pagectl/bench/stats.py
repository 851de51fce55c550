"""Percentiles and latency summaries, in plain Python (no numpy needed by the client side)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks.

    Same definition as ``numpy.percentile``'s default ("linear"). NaN for an empty input.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return float(xs[lo])
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(
    values: Sequence[float], percentiles: Sequence[int] = PERCENTILES
) -> dict[str, float]:
    """mean and the given percentiles, e.g. {"mean": .., "p50": .., "p90": .., "p99": ..}."""
    out = {"mean": sum(values) / len(values) if values else math.nan}
    for q in percentiles:
        out[f"p{q}"] = percentile(values, q)
    return out


@dataclass
class RequestTiming:
    """What a streaming client saw of one request. Times are ``time.perf_counter()`` values."""

    # When the request was sent.
    start: float
    # Arrival time of every chunk that carried at least one output token, and how many tokens
    # each carried (1 per chunk from a server that streams one token per chunk).
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    # When the response ended (after the last chunk / [DONE]).
    end: float = 0.0
    # Output tokens as the server's usage reported them (None when it sent no usage).
    usage_output_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def output_tokens(self) -> int:
        if self.usage_output_tokens is not None:
            return self.usage_output_tokens
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (last token - first token) / (n - 1)."""
        n = self.output_tokens
        if n < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (n - 1)

    def itls(self) -> list[float]:
        """Gaps between consecutive token-carrying chunks."""
        t = self.chunk_times
        return [t[i] - t[i - 1] for i in range(1, len(t))]


def serving_metrics(timings: Sequence[RequestTiming], duration_s: float) -> dict:
    """Throughput and latency figures of one serving run (times in milliseconds)."""
    ok = [t for t in timings if t.ok]
    out_tokens = sum(t.output_tokens for t in ok)
    tpots = [x for x in (t.tpot for t in ok) if x is not None]
    itls = [x for t in ok for x in t.itls()]

    def ms(seconds: Sequence[float]) -> dict[str, float]:
        return {k: v * 1000.0 for k, v in summarize(seconds).items()}

    return {
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else math.nan,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else math.nan,
        "total_output_tokens": out_tokens,
        "ttft_ms": ms([t.ttft for t in ok]),
        "tpot_ms": ms(tpots),
        "itl_ms": ms(itls),
        "e2e_ms": ms([t.latency for t in ok]),
    }
