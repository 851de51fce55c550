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
