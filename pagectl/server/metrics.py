"""Prometheus metrics (``GET /metrics``). Names and meanings are listed in docs/METRICS.md.

Engine figures (requests, KV usage, prefix cache, preemptions, token totals) are read at
scrape time from the latest ``EngineStats`` each engine sent (at most 100 ms old), so they
are the engines' own counters, never re-counted here; every such series carries an
``engine`` label, the engine's data-parallel rank ("0" for a daemon of one engine), as
vLLM's do. Latency histograms and finish reasons are
observed in the API server, which sees every token arrive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

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
    """Gauges and counters taken from each engine's latest stats at scrape time, one series
    per engine with its data-parallel rank as the ``engine`` label (as vLLM's)."""

    def __init__(self, get_stats: Callable[[], Sequence[EngineStats | None]]) -> None:
        self.get_stats = get_stats

    def collect(self) -> Iterator[Metric]:
        engines = [(str(i), s) for i, s in enumerate(self.get_stats()) if s is not None]
        if not engines:
            return
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

        def put(
            kind: type[GaugeMetricFamily | CounterMetricFamily],
            name: str,
            doc: str,
            engine: str,
            value: float,
        ) -> None:
            fam = families.get(name)
            if fam is None:
                fam = families[name] = kind(name, doc, labels=["engine"])
            fam.add_metric([engine], value)

        pre = CounterMetricFamily(
            "pagectl:num_preemptions", "Preemptions by reason.", labels=["engine", "reason"]
        )
        for engine, s in engines:
            for kind, name, doc, value in _engine_series(s):
                put(kind, name, doc, engine, value)
            # Every known reason from the start (0), so rate() works before the first one.
            by_reason = {reason: 0 for reason in PREEMPTION_REASONS}
            by_reason.update(s.counters.preemptions_by_reason)
            for reason, n in sorted(by_reason.items()):
                pre.add_metric([engine, reason], n)
        yield from families.values()
        yield pre
        spec = [(e, s) for e, s in engines if s.config.get("speculative_method", "none") != "none"]
        if spec:
            yield from _spec_decode_metrics(spec)


_G, _C = GaugeMetricFamily, CounterMetricFamily


def _engine_series(s: EngineStats) -> list[tuple[type, str, str, float]]:
    """(family type, name, help, value) of one engine's plain series."""
    c = s.counters
    return [
        (_G, "pagectl:num_requests_running", "Sequences running in the engine.", s.num_running),
        (_G, "pagectl:num_requests_waiting", "Sequences waiting for admission.", s.num_waiting),
        (
            _G,
            "pagectl:kv_cache_usage_perc",
            "Fraction of KV blocks in use (refcount > 0), 0-1.",
            s.num_used_blocks / s.num_blocks if s.num_blocks else 0.0,
        ),
        (
            _G,
            "pagectl:kv_cache_token_usage_perc",
            "Fraction of KV token slots holding live tokens, 0-1.",
            s.num_used_token_slots / s.num_token_slots if s.num_token_slots else 0.0,
        ),
        (
            _C,
            "pagectl:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache at first admission.",
            c.prefix_queries,
        ),
        (
            _C,
            "pagectl:prefix_cache_hits",
            "Prompt tokens served by the prefix cache.",
            c.prefix_hits,
        ),
        (
            _C,
            "pagectl:prompt_tokens",
            "Prompt tokens prefilled by the engine (prefix-cache hits excluded).",
            c.prompt_tokens,
        ),
        (_C, "pagectl:generation_tokens", "Tokens generated.", c.generation_tokens),
        (
            _C,
            "pagectl:structured_outputs_compiles",
            "Grammars compiled for structured outputs (cache misses).",
            c.grammar_compiles,
        ),
        (
            _C,
            "pagectl:structured_outputs_compile_seconds",
            "Seconds spent compiling grammars (on the compile thread, off the engine step).",
            c.grammar_compile_seconds,
        ),
        (
            _C,
            "pagectl:structured_outputs_cache_hits",
            "Constrained requests served by the compiled-grammar cache.",
            c.grammar_cache_hits,
        ),
        (
            _C,
            "pagectl:kv_events_published",
            "KV-event batches sent (--kv-events-config).",
            s.kv_events_published,
        ),
        (
            _C,
            "pagectl:kv_events_dropped",
            "KV-event batches dropped because the publisher's queue was full.",
            s.kv_events_dropped,
        ),
    ]


def _spec_decode_metrics(engines: list[tuple[str, EngineStats]]) -> Iterator[Metric]:
    """Speculative decoding counters, named as vLLM's (only when it is configured)."""
    fams = [
        _C(
            "pagectl:spec_decode_num_drafts",
            "Verifications run (one per sequence per step with proposals).",
            labels=["engine"],
        ),
        _C("pagectl:spec_decode_num_draft_tokens", "Tokens proposed.", labels=["engine"]),
        _C(
            "pagectl:spec_decode_num_accepted_tokens",
            "Proposed tokens accepted.",
            labels=["engine"],
        ),
    ]
    per_pos = CounterMetricFamily(
        "pagectl:spec_decode_num_accepted_tokens_per_pos",
        "Accepted proposals by position in the proposed run (0: the first).",
        labels=["engine", "position"],
    )
    for engine, s in engines:
        c = s.counters
        for fam, value in zip(
            fams,
            (
                c.spec_decode_num_drafts,
                c.spec_decode_num_draft_tokens,
                c.spec_decode_num_accepted_tokens,
            ),
            strict=True,
        ):
            fam.add_metric([engine], value)
        for pos, value in enumerate(c.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([engine, str(pos)], value)
    yield from fams
    yield per_pos


class Metrics:
    """One registry per server (never the global one), so several apps can live in a process."""

    def __init__(self, get_stats: Callable[[], Sequence[EngineStats | None]]) -> None:
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
