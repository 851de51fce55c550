"""``InProcessEngine``: the ``EngineClient`` interface over an in-process ``EngineCore``,
for aiohttp_client tests of the HTTP layer (no processes, no sockets)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from pagectl.engine.core import EngineCore
from pagectl.engine.outputs import EngineRequest
from pagectl.engine_process import wire
from pagectl.engine_process.client import (
    EngineClientProtocol,
    EngineDeadError,
    OutputQueue,
    OutputRouter,
    RequestRejected,
)
from pagectl.engine_process.loop import engine_stats
from pagectl.engine_process.main import Built, engine_ready


class InProcessEngine(OutputRouter):
    """Runs an EngineCore on the event loop (one step per loop turn); same methods as
    ``EngineClient`` (and the same output routing), for HTTP tests without processes or
    sockets."""

    def __init__(self, built: Built) -> None:
        super().__init__()
        self.built = built
        self.core: EngineCore = built.core
        self.stats: wire.EngineStats | None = None
        self.dead: str | None = None
        self.ready: wire.EngineReady | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.aborted: list[str] = []

    def engine_stats(self) -> list[wire.EngineStats | None]:
        return [self.stats]

    def _update_stats(self) -> None:
        self.stats = engine_stats(self.core.snapshot())

    async def start(self) -> wire.EngineReady:
        self.ready = engine_ready(self.built)
        self._update_stats()
        self._task = asyncio.create_task(self._run())
        return self.ready

    async def _run(self) -> None:
        core = self.core
        while True:
            if not core.has_unfinished():
                self._update_stats()
                self._wake.clear()
                await self._wake.wait()
            for out in core.step():
                self._deliver(out.request_id, out)
            self._update_stats()
            await asyncio.sleep(0)

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def submit(self, request: EngineRequest, queue: OutputQueue) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self._add_route(request.request_id, queue)
        try:
            self.core.add_engine_request(request)
        except Exception as e:  # as the engine process does
            self._deliver(request.request_id, RequestRejected(str(e)))
        self._wake.set()

    def abort(self, request_ids: list[str]) -> None:
        self.release(request_ids)
        for rid in request_ids:
            self.aborted.append(rid)
            self.core.abort_request(rid)
        self._wake.set()

    def abort_all(self) -> None:
        for rid in list(self._routes):
            self.core.abort_request(rid)
        self._wake.set()

    def finish_stop_string(self, request_id: str, index: int, stop: str) -> None:
        self.core.finish_by_stop_string(request_id, index, stop)

    def set_draining(self, draining: bool = True) -> None:
        self.core.state_override = "draining" if draining else None

    def kill(self, reason: str = "killed by the test") -> None:
        """Behave as if the engine process died."""
        self.dead = reason
        self._fail_all(EngineDeadError(reason))


if TYPE_CHECKING:  # mypy checks that the doubles have what their users need
    from pagectl.engine.builder import BuiltEngine
    from pagectl.testing.fake_engine import FakeBuiltEngine

    def _conforms(engine: InProcessEngine) -> EngineClientProtocol:
        return engine

    def _built(real: BuiltEngine, fake: FakeBuiltEngine) -> list[Built]:
        return [real, fake]
