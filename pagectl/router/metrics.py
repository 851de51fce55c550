"""The router's own ``/metrics``: requests, routing decisions, retries, stream errors, and each
backend's health, in-flight count and KV-event stream, as the router sees them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class RouterMetrics:
    def __init__(self) -> None:
        reg = self.registry = CollectorRegistry()
        self.requests = Counter(
            "pagectl_router:requests",
            "Requests answered, by backend and status (backend 'none': no backend took it).",
            ["backend", "status"],
            registry=reg,
        )
        self.decisions = Counter(
            "pagectl_router:routing_decisions",
            "Routing decisions by backend and reason (prefix, load, round_robin, skew).",
            ["backend", "reason"],
            registry=reg,
        )
        self.matched_blocks = Counter(
            "pagectl_router:prefix_matched_blocks",
            "Leading request blocks the chosen backend held, per its KV events.",
            ["backend"],
            registry=reg,
        )
        self.retries = Counter(
            "pagectl_router:retries",
            "Requests sent to another backend after a refusal.",
            registry=reg,
        )
        self.stream_errors = Counter(
            "pagectl_router:stream_errors",
            "Streams ended with an error event because their backend was lost.",
            ["backend"],
            registry=reg,
        )
        self.up = Gauge(
            "pagectl_router:backend_up", "1 if the backend is alive.", ["backend"], registry=reg
        )
        self.inflight = Gauge(
            "pagectl_router:backend_inflight",
            "Requests in flight per backend.",
            ["backend"],
            registry=reg,
        )
        self.event_batches = Gauge(
            "pagectl_router:kv_event_batches",
            "KV-event batches applied per backend.",
            ["backend"],
            registry=reg,
        )
        self.event_gaps = Gauge(
            "pagectl_router:kv_event_gaps",
            "Gaps in a backend's KV-event sequence numbers.",
            ["backend"],
            registry=reg,
        )
