"""Prometheus metrics (``GET /metrics``). Names and meanings are listed in docs/METRICS.md.

Engine figures (requests, KV usage, prefix cache, preemptions, token totals) are read at
scrape time from the latest ``EngineStats`` the engine sent (at most 100 ms old), so they are
the engine's own counters, never re-counted here. Latency histograms and finish reasons are
observed in the API server, which sees every token arrive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagectl.engine.scheduler import PREEMPT_KV_BLOCKS
from pagectl.engine_process.wire import EngineStats

PREEMPTION_REASONS = (PREEMPT_KV_BLOCKS,)

# No ``*_created`` series: they double the output and no dashboard here reads them.
disable_created_metrics()

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


class _EngineCollector:
    """Gauges and counters taken from the engine's latest stats at scrape time."""

    def __init__(self, get_stats: Callable[[], EngineStats | None]) -> None:
        self.get_stats = get_stats

    def collect(self) -> Iterator[Metric]:
        s = self.get_stats()
        if s is None:
            return
        c = s.counters
        yield _gauge(
            "pagectl:num_requests_running", "Sequences running in the engine.", s.num_running
        )
        yield _gauge(
            "pagectl:num_requests_waiting", "Sequences waiting for admission.", s.num_waiting
        )
        yield _gauge(
            "pagectl:kv_cache_usage_perc",
            "Fraction of KV blocks in use (refcount > 0), 0-1.",
            s.num_used_blocks / s.num_blocks if s.num_blocks else 0.0,
        )
        yield _gauge(
            "pagectl:kv_cache_token_usage_perc",
            "Fraction of KV token slots holding live tokens, 0-1.",
            s.num_used_token_slots / s.num_token_slots if s.num_token_slots else 0.0,
        )
        yield _counter(
            "pagectl:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache at first admission.",
            c.prefix_queries,
        )
        yield _counter(
            "pagectl:prefix_cache_hits", "Prompt tokens served by the prefix cache.", c.prefix_hits
        )
        pre = CounterMetricFamily(
            "pagectl:num_preemptions", "Preemptions by reason.", labels=["reason"]
        )
        # Every known reason from the start (0), so rate() works before the first one.
        by_reason = {reason: 0 for reason in PREEMPTION_REASONS}
        by_reason.update(c.preemptions_by_reason)
        for reason, value in sorted(by_reason.items()):
            pre.add_metric([reason], value)
        yield pre
        yield _counter(
            "pagectl:prompt_tokens",
            "Prompt tokens prefilled by the engine (prefix-cache hits excluded).",
            c.prompt_tokens,
        )
        yield _counter("pagectl:generation_tokens", "Tokens generated.", c.generation_tokens)
        yield _counter(
            "pagectl:structured_outputs_compiles",
            "Grammars compiled for structured outputs (cache misses).",
            c.grammar_compiles,
        )
        yield _counter(
            "pagectl:structured_outputs_compile_seconds",
            "Seconds spent compiling grammars (on the compile thread, off the engine step).",
            c.grammar_compile_seconds,
        )
        yield _counter(
            "pagectl:structured_outputs_cache_hits",
            "Constrained requests served by the compiled-grammar cache.",
            c.grammar_cache_hits,
        )
        yield _counter(
            "pagectl:kv_events_published",
            "KV-event batches sent (--kv-events-config).",
            s.kv_events_published,
        )
        yield _counter(
            "pagectl:kv_events_dropped",
            "KV-event batches dropped because the publisher's queue was full.",
            s.kv_events_dropped,
        )
        if s.config.get("speculative_method", "none") != "none":
            yield from _spec_decode_metrics(c)


def _spec_decode_metrics(c) -> Iterator[Metric]:
    """Speculative decoding counters, named as vLLM's (only when it is configured)."""
    yield _counter(
        "pagectl:spec_decode_num_drafts",
        "Verifications run (one per sequence per step with proposals).",
        c.spec_decode_num_drafts,
    )
    yield _counter(
        "pagectl:spec_decode_num_draft_tokens",
        "Tokens proposed.",
        c.spec_decode_num_draft_tokens,
    )
    yield _counter(
        "pagectl:spec_decode_num_accepted_tokens",
        "Proposed tokens accepted.",
        c.spec_decode_num_accepted_tokens,
    )
    per_pos = CounterMetricFamily(
        "pagectl:spec_decode_num_accepted_tokens_per_pos",
        "Accepted proposals by position in the proposed run (0: the first).",
        labels=["position"],
    )
    for pos, value in enumerate(c.spec_decode_num_accepted_tokens_per_pos):
        per_pos.add_metric([str(pos)], value)
    yield per_pos


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class Metrics:
    """One registry per server (never the global one), so several apps can live in a process."""

    def __init__(self, get_stats: Callable[[], EngineStats | None]) -> None:
        reg = self.registry = CollectorRegistry(auto_describe=True)
        self.request_success = Counter(
            "pagectl:request_success",
            "Finished sequences (choices) by finish reason.",
            ["finished_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            "pagectl:time_to_first_token_seconds",
            "Time from arrival to the request's first generated token.",
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "pagectl:inter_token_latency_seconds",
            "Time between consecutive tokens of one sequence.",
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "pagectl:e2e_request_latency_seconds",
            "Time from arrival to the request's last token.",
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        self.cache_config = Info("pagectl:cache_config", "KV cache configuration.", registry=reg)
        reg.register(_EngineCollector(get_stats))

    def set_cache_config(self, config: dict) -> None:
        self.cache_config.info({k: str(v) for k, v in sorted(config.items())})

    def render(self) -> bytes:
        return generate_latest(self.registry)
