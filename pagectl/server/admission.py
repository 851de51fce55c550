"""One admission slot per HTTP generation request, taken and released in one place.

``admitted(state, gen)`` wraps the whole life of a request from the admission check to the
last byte: whatever fails inside -- validation that runs late, a submit that raises, the
engine refusing the request, the client going away (cancellation) -- the ``finally`` below
aborts what is still running in the engine, stops routing every engine request id the
request owns (so ``engine.num_unstarted``, which ``--max-num-queued-requests`` counts,
cannot keep a dead request), and gives the slot back. No other code changes these counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def admitted(state: Any, gen: Any) -> Iterator[None]:
    """Admit ``gen`` (a ``serving.Generation``) or raise the 503 of ``check_admission``."""
    state.check_admission()
    state.begin()
    try:
        yield
    finally:
        try:
            gen.close()
        finally:
            # Every id, submitted or not: a submit that raised half-way leaves no route.
            state.engine.release([run.request_id for run in gen.runs])
            state.end()


def register_admission_gauges(registry: Any, state: Any) -> None:
    """``/metrics`` gauges of the counts ``admitted`` keeps: HTTP generation requests in
    flight, and engine requests submitted with no output yet (what
    --max-num-queued-requests limits). Both are 0 on an idle server; anything else leaked."""
    from prometheus_client import Gauge

    Gauge(
        "pagectl:http_requests_active",
        "HTTP generation requests being served (admission slots taken).",
        registry=registry,
    ).set_function(lambda: state.num_active)
    Gauge(
        "pagectl:engine_requests_unstarted",
        "Engine requests submitted that have had no output yet (the queue limit's count).",
        registry=registry,
    ).set_function(lambda: state.engine.num_unstarted)
