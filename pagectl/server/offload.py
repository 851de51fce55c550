"""CPU-heavy work of the API server, run off the event loop in a bounded thread pool.

Tokenizing a prompt, rendering a chat template, parsing a large JSON body and detokenizing a
long id list can each take seconds; on the event loop they would freeze every stream and
``/health`` meanwhile. ``Offload.run(fn, *args)`` runs ``fn`` in a worker thread instead (the
Rust tokenizer releases the GIL while it works).

Bounds: ``max_workers`` threads (default 1: Hugging Face tokenizers are not safe to call
from several threads at once, and one thread keeps the API server's CPU use bounded), and
at most ``max_pending`` calls waiting or running; past that a call gets a 503 with
Retry-After instead of queueing without end. The size of each piece of work is bounded by
its caller (``--max-prompt-bytes``, the body limit) before it is handed over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagectl.server.errors import APIError

T = TypeVar("T")

DEFAULT_MAX_PENDING = 64


class Offload:
    def __init__(self, max_workers: int = 1, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self.max_pending = max_pending
        self.pending = 0
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="offload")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread (503 when ``max_pending`` calls are in)."""
        if self.pending >= self.max_pending:
            raise APIError(
                503,
                f"the server is overloaded: {self.pending} tokenization jobs are queued; "
                "retry later",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.pending -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
