"""The API server's side of the engine process: spawn, handshake, route outputs, watch.

Runs on the API server's asyncio loop; nothing here is thread-safe. Each HTTP request owns
one ``asyncio.Queue``; every engine request it submits routes its outputs there, so a
handler sees its outputs in engine order. When the engine dies, every registered queue gets
an ``EngineDeadError`` and ``on_dead`` callbacks run.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from pagectl.engine.outputs import EngineCoreOutput, EngineRequest
from pagectl.engine_process import wire
from pagectl.engine_process.frames import MAX_OUTPUT_FRAME_BYTES, FrameError, decode_frame
from pagectl.engine_process.main import EngineProcConfig

# How often the engine process is polled for an unexpected exit.
_WATCH_INTERVAL_S = 0.1


class EngineError(Exception):
    """Base of the errors a request can get from the engine side."""


class EngineDeadError(EngineError):
    """The engine process died or reported a fatal error."""


class EngineStartError(EngineError):
    """The engine process could not start."""


class RequestRejected(EngineError):
    """The engine refused one request (its own validation); nothing else is affected."""


# What an HTTP request's queue receives: its engine outputs in engine order, or the error
# that ends it (``RequestRejected`` for one engine request, ``EngineDeadError`` for all).
OutputQueue = asyncio.Queue[EngineCoreOutput | EngineError]


class EngineClientProtocol(Protocol):
    """What the API server needs from an engine: start and stop it, add requests and stream
    their outputs to a queue, abort, stop a sequence at a stop string, drain.

    Implemented by ``EngineClient`` (the engine-core process over ZMQ) and
    ``pagectl.testing.in_process.InProcessEngine`` (an ``EngineCore`` on the event loop).
    Event loop thread only.
    """

    # The engine's handshake, once started.
    ready: wire.EngineReady | None

    @property
    def stats(self) -> wire.EngineStats | None:
        """The latest figures from the engine (engine 0's under data parallelism), once it
        sent any."""
        ...

    # Why the engine is dead, or None while it lives.
    dead: str | None

    @property
    def num_unstarted(self) -> int:
        """Submitted requests with no output yet: queued for admission or prefilling."""
        ...

    def engine_stats(self) -> list[wire.EngineStats | None]:
        """The latest figures of each engine, by data-parallel rank (one for one engine)."""
        ...

    async def start(self) -> wire.EngineReady:
        """Start the engine; returns its handshake. Raises ``EngineStartError``."""
        ...

    async def shutdown(self) -> object:
        """Stop the engine (after the server stopped serving)."""
        ...

    def submit(self, request: EngineRequest, queue: OutputQueue) -> None:
        """Add one request; its outputs (and any failure) arrive on ``queue``. Raises
        ``EngineDeadError`` when the engine is gone."""
        ...

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests in the engine (their blocks are freed) and stop routing them."""
        ...

    def release(self, request_ids: list[str]) -> None:
        """Stop routing outputs of these requests (their handler is done with them)."""
        ...

    def abort_all(self) -> None:
        """Abort every routed request, keeping the routes: handlers get the final outputs."""
        ...

    def finish_stop_string(self, request_id: str, index: int, stop: str) -> None:
        """Finish one sample whose text hit a stop string (found by the output processor)."""
        ...

    def set_draining(self, draining: bool = True) -> None:
        """Report the engine as draining (or not) in its telemetry."""
        ...


class ServerStoppingError(EngineError):
    """The daemon is stopping now (a second SIGTERM): in-flight requests end with this."""


class OutputRouter:
    """Routes engine outputs to the queue of the HTTP request that owns them.

    Shared by ``EngineClient`` and the in-process test engine, so both route, release and
    fail requests the same way. Event loop thread only.
    """

    def __init__(self) -> None:
        # engine request id -> the queue of the HTTP request that owns it.
        self._routes: dict[str, OutputQueue] = {}
        # Submitted requests that have had no output yet (waiting for admission or prefill).
        self._unstarted: set[str] = set()

    @property
    def num_unstarted(self) -> int:
        """Submitted requests with no output yet: queued for admission or prefilling."""
        return len(self._unstarted)

    def _add_route(self, request_id: str, queue: OutputQueue) -> None:
        self._routes[request_id] = queue
        self._unstarted.add(request_id)

    def release(self, request_ids: list[str]) -> None:
        """Stop routing outputs of these requests (their handler is done with them)."""
        for rid in request_ids:
            self._routes.pop(rid, None)
            self._unstarted.discard(rid)

    def _deliver(self, request_id: str, item: EngineCoreOutput | EngineError) -> None:
        """Hand an output (or a ``RequestRejected``) to the request's queue, if still routed."""
        q = self._routes.get(request_id)
        if q is not None:
            self._unstarted.discard(request_id)
            q.put_nowait(item)

    def fail_all(self, err: EngineError) -> None:
        """End every routed request with ``err`` (their handlers answer and release)."""
        self._fail_all(err)

    def _fail_all(self, err: EngineError) -> None:
        # One error per HTTP request, even when it owns several engine requests.
        for q in {id(q): q for q in self._routes.values()}.values():
            q.put_nowait(err)
        self._unstarted.clear()


class EngineClient(OutputRouter):
    """Spawns and talks to the engine-core process.

    Args:
        proc_config: what the engine process needs except the internal endpoints, which
            are bound here (``input_endpoint`` / ``output_endpoint`` are overwritten).
        input_endpoint / output_endpoint: where to bind the internal PUSH / PULL sockets.
    """

    def __init__(
        self, proc_config: EngineProcConfig, *, input_endpoint: str, output_endpoint: str
    ) -> None:
        super().__init__()
        self.proc_config = proc_config
        self._input_endpoint = input_endpoint
        self._output_endpoint = output_endpoint
        self.ctx = zmq.asyncio.Context()
        self.proc: subprocess.Popen | None = None
        self.ready: wire.EngineReady | None = None
        # Latest figures from the engine (for /metrics and /health).
        self.stats: wire.EngineStats | None = None
        # Why the engine is dead, or None while it lives.
        self.dead: str | None = None
        # time.monotonic() of the last frame from the engine (stats arrive at the telemetry
        # rate between steps): /health reports a stalled engine from it.
        self.last_heard = 0.0
        self.on_dead: list[Callable[[str], None]] = []
        self._closing = False
        self._tasks: list[asyncio.Task] = []
        self._push: zmq.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None

    # -- life cycle ---------------------------------------------------------------------

    def _bind(self) -> None:
        # The sending side is a plain (blocking API) socket used only with NOBLOCK and no
        # high-water mark, so submit/abort are synchronous and never wait; the receiving
        # side is an asyncio socket read by one reader task.
        sync_ctx: zmq.Context = zmq.Context.shadow(self.ctx.underlying)
        push = sync_ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.setsockopt(zmq.LINGER, 0)
        push.bind(self._input_endpoint)
        pull = self.ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(self._output_endpoint)
        self._push, self._pull = push, pull
        self.proc_config.input_endpoint = push.getsockopt_string(zmq.LAST_ENDPOINT)
        self.proc_config.output_endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)

    async def start(self) -> wire.EngineReady:
        """Spawn the engine process and wait for its handshake (as long as it lives)."""
        self._bind()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagectl.engine_process.main"], stdin=subprocess.PIPE
        )
        assert self.proc.stdin is not None
        # The pipe stays open for the engine's lifetime: its EOF tells the engine we died.
        self.proc.stdin.write(msgspec.json.encode(self.proc_config) + b"\n")
        self.proc.stdin.flush()
        assert self._pull is not None
        while True:
            if await self._pull.poll(int(_WATCH_INTERVAL_S * 1000)):
                msg = wire.decode_from_engine(await self._pull.recv())
                if isinstance(msg, wire.EngineReady):
                    self.ready = msg
                    self.last_heard = time.monotonic()
                    break
                if isinstance(msg, wire.EngineStartFailed):
                    await self._reap(5.0)
                    raise EngineStartError(msg.message)
            elif self.proc.poll() is not None:
                raise EngineStartError(
                    f"the engine process exited with status {self.proc.returncode} during start-up"
                )
        self._tasks = [
            asyncio.create_task(self._read_outputs(), name="engine-outputs"),
            asyncio.create_task(self._watch_process(), name="engine-watch"),
        ]
        return self.ready

    async def _reap(self, timeout: float) -> int | None:
        proc = self.proc
        if proc is None:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while proc.poll() is None and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
            await asyncio.sleep(0)
            proc.wait()
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        return proc.returncode

    async def shutdown(self, timeout: float = 10.0) -> int | None:
        """Ask the engine to exit, wait for it (kill it after ``timeout``); close sockets."""
        self._closing = True
        if self.proc is not None and self.proc.poll() is None:
            if self.ready is None:
                self.proc.terminate()  # still loading: nothing to drain, no loop to ask
            elif self.dead is None:
                self._send(wire.Shutdown())
        rc = await self._reap(timeout)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        self.ctx.term()
        return rc

    def engine_stats(self) -> list[wire.EngineStats | None]:
        return [self.stats]

    # -- requests -----------------------------------------------------------------------

    def _send(self, msg: msgspec.Struct) -> None:
        self._send_frame(wire.encode(msg))

    def _send_frame(self, frame: bytes) -> None:
        if self._push is None:
            raise EngineDeadError("the engine is not running")
        try:
            self._push.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"the engine is not reachable: {e}") from None

    def _notify(self, msg: msgspec.Struct) -> None:
        """Send a message whose loss does not matter once the engine is dead."""
        if self.dead is None:
            with contextlib.suppress(EngineDeadError):
                self._send(msg)

    def submit(self, request: EngineRequest, queue: OutputQueue) -> None:
        """Send one request; its outputs (and any failure) will arrive on ``queue``."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        rid = request.request_id
        try:  # encoded before it is routed: a value msgpack cannot carry leaves no route
            frame = wire.encode(wire.SubmitRequest(request))
        except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as e:
            raise RequestRejected(f"the request cannot be sent to the engine: {e}") from None
        self._add_route(rid, queue)
        try:
            self._send_frame(frame)
        except BaseException:
            self.release([rid])
            raise

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests in the engine (frees their blocks at the next step) and release."""
        self.release(request_ids)
        if request_ids:
            self._notify(wire.AbortRequests(list(request_ids)))

    def abort_all(self) -> None:
        """Abort every routed request in the engine, keeping the routes: their handlers get
        the engine's final "abort" outputs and answer their clients."""
        if self._routes:
            self._notify(wire.AbortRequests(list(self._routes)))

    def finish_stop_string(self, request_id: str, index: int, stop: str) -> None:
        self._notify(wire.FinishStopString(request_id, index, stop))

    def set_draining(self, draining: bool = True) -> None:
        self._notify(wire.SetDraining(draining))

    # -- background tasks ---------------------------------------------------------------

    async def _read_outputs(self) -> None:
        assert self._pull is not None
        deliver = self._deliver
        while True:
            frame = await self._pull.recv()
            self.last_heard = time.monotonic()
            try:
                msg = decode_frame(wire.from_engine_decoder, frame, MAX_OUTPUT_FRAME_BYTES)
            except FrameError:
                continue
            if isinstance(msg, wire.OutputBatch):
                for out in msg.outputs:
                    deliver(out.request_id, out)
            elif isinstance(msg, wire.EngineStats):
                self.stats = msg
            elif isinstance(msg, wire.RequestFailed):
                deliver(msg.request_id, RequestRejected(msg.message))
            elif isinstance(msg, wire.EngineDead):
                self._mark_dead(msg.message)

    async def _watch_process(self) -> None:
        assert self.proc is not None
        while self.proc.poll() is None:
            await asyncio.sleep(_WATCH_INTERVAL_S)
        if not self._closing:
            self._mark_dead(
                f"the engine process exited unexpectedly (status {self.proc.returncode})"
            )

    def _mark_dead(self, reason: str) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        self._fail_all(EngineDeadError(reason))
        for cb in list(self.on_dead):
            cb(reason)
