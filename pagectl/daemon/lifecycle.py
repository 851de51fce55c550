"""``pagectl daemon``: run the API server, the engine process and the admin channel.

Life cycle:
1. Remove the directories of dead daemons from the runtime dir, create this daemon's 0700
   directory there and the 0600 control token (an unsafe runtime dir is refused, never
   chmodded: ``control.runtime.runtime_base``).
2. Start the app: its cleanup_ctx spawns the engine process and waits for the handshake.
3. Listen on HTTP, then write the runtime file (so finders only see a daemon that serves).
4. Until SIGTERM/SIGINT: serve. If the engine dies, in-flight requests get an error,
   /health answers 503 for a short grace period, and the daemon exits 1. With N > 1
   data-parallel engines (``--data-parallel-size``), one engine dying fails only the
   requests it held; the others serve on (/health: 200 "degraded") until the last dies
   (exit 1), or, with ``--exit-on-engine-death``, the daemon drains the survivors and
   exits 1 (docs/DATA_PARALLEL.md says why serving on is the default).
5. On SIGTERM/SIGINT: drain. New requests get 503; in-flight ones run to completion for at
   most ``drain_timeout`` seconds, then are aborted; the engine is shut down and the daemon
   exits 0. A second signal skips the rest of the drain: every in-flight request ends with
   a 503 ``shutting_down`` error (a stream: an error event, then ``[DONE]``).
Every exit path removes the runtime directory and leaves no child process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

from aiohttp import web

from pagectl.control.protocol import EngineEndpoints, RuntimeInfo
from pagectl.control.runtime import DaemonDir, loopback_only
from pagectl.control.telemetry_auth import server_mode
from pagectl.daemon.dp import engine_args_for_rank, kv_events_for_rank, rank_endpoint, wants_cuda
from pagectl.engine.args import EngineArgs
from pagectl.engine_process.client import EngineClient, EngineStartError, ServerStoppingError
from pagectl.engine_process.dp_client import DPCollector, DPEngineClient
from pagectl.engine_process.main import EngineProcConfig
from pagectl.routing.policy import RoutingPolicy
from pagectl.server.app import create_app
from pagectl.server.connections import GuardedAppRunner
from pagectl.server.state import STATE, ServerSettings

log = logging.getLogger("pagectl.daemon")

# Seconds /health keeps answering 503 after the engine died, before the daemon exits.
DEAD_GRACE_S = 1.5
# Seconds handlers get to answer after an aborted drain, before connections are closed.
ABORT_GRACE_S = 3.0


@dataclass
class DaemonOptions:
    engine_args: EngineArgs
    server: ServerSettings
    host: str = "127.0.0.1"
    port: int = 8000
    runtime_dir: str | None = None
    # Admin endpoints (default: ipc:// sockets in the daemon's directory).
    telemetry_endpoint: str | None = None
    control_endpoint: str | None = None
    # "module:function" replacing the engine builder (tests).
    engine_factory: str | None = None
    drain_timeout: float = 30.0
    telemetry_hz: float = 10.0
    # ``--telemetry-public``: telemetry over tcp:// or ipc://@ asks no token.
    telemetry_public: bool = False
    # ``--kv-events-config`` as parsed (vLLM's KVEventsConfig fields), or None.
    kv_events_config: dict | None = None
    # Data parallelism (docs/DATA_PARALLEL.md): engine processes behind the API server.
    data_parallel_size: int = 1
    # CPU threads per engine (None: an even split of the cores).
    dp_cpu_threads: int | None = None
    # Routing policy among the engines (prefix | load | round_robin) and its skew bound.
    dp_routing: str = "prefix"
    dp_max_skew: int = 4
    # Exit (after draining the survivors) when any engine dies, not only the last.
    exit_on_engine_death: bool = False
    # The API server's log level ("debug" logs every routing decision's inputs).
    log_level: str = "info"


def _say(msg: str) -> None:
    print(f"pagectl daemon: {msg}", file=sys.stderr, flush=True)


class _Lifecycle:
    """Signals and engine death -> one stop event and the exit status."""

    def __init__(
        self,
        state,
        engine: EngineClient | DPEngineClient,
        drain_timeout: float,
        exit_on_engine_death: bool = False,
    ) -> None:
        self.state = state
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.exit_on_engine_death = exit_on_engine_death
        self.stop = asyncio.Event()
        self.exit_code = 0
        self._drain_task: asyncio.Task | None = None
        self._stop_task: asyncio.Task | None = None

    def on_signal(self, signame: str) -> None:
        if self._drain_task is None:
            _say(f"{signame} received: draining (a second signal stops at once)")
            self._drain_task = asyncio.create_task(self._drain())
        elif self._stop_task is None:
            _say(f"{signame} received again: stopping now (in-flight requests get an error)")
            self._stop_task = asyncio.create_task(self._stop_now())

    async def _stop_now(self) -> None:
        """End every in-flight request with an error (streams get an error event and
        [DONE]), give their handlers a moment to send it, then stop."""
        self.engine.abort_all()
        self.engine.fail_all(ServerStoppingError("the server is stopping"))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.state.idle.wait(), ABORT_GRACE_S)
        self.stop.set()

    def on_engine_dead(self, reason: str) -> None:
        _say(f"engine died: {reason}; exiting")
        self.exit_code = 1
        asyncio.get_running_loop().call_later(DEAD_GRACE_S, self.stop.set)

    def on_one_engine_dead(self, index: int, reason: str) -> None:
        """One of N data-parallel engines died (its requests already failed)."""
        engine = self.engine
        assert isinstance(engine, DPEngineClient)
        alive, n = engine.num_alive, len(engine.engines)
        if alive == 0:
            return  # on_engine_dead stops the daemon
        if self.exit_on_engine_death:
            _say(
                f"engine {index} died: {reason}; draining the other {alive} and exiting "
                "(--exit-on-engine-death)"
            )
            self.exit_code = 1
            if self._drain_task is None:
                self._drain_task = asyncio.create_task(self._drain())
        else:
            _say(f"engine {index} died: {reason}; serving on {alive} of {n} engines (degraded)")

    async def _drain(self) -> None:
        state = self.state
        state.draining = True
        self.engine.set_draining(True)
        try:
            await asyncio.wait_for(state.idle.wait(), self.drain_timeout)
        except asyncio.TimeoutError:
            _say(f"drain timeout ({self.drain_timeout:g}s): aborting {state.num_active} requests")
            self.engine.abort_all()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(state.idle.wait(), ABORT_GRACE_S)
        self.stop.set()


async def serve(opts: DaemonOptions) -> int:
    """Run the daemon until it is stopped; returns the exit status."""
    try:
        ddir = DaemonDir(opts.runtime_dir)
    except OSError as e:  # a runtime dir we refuse to use (see control.runtime.runtime_base)
        _say(str(e))
        return 2
    try:
        tel = opts.telemetry_endpoint or ddir.endpoint("telemetry")
        ctl = opts.control_endpoint or ddir.endpoint("control")
        loopback_only(tel)
        loopback_only(ctl)
        ddir.create_token()
        try:
            engine = _engines(opts, ddir, tel, ctl)
        except ValueError as e:
            _say(str(e))
            return 2
        app = create_app(opts.server, engine)
        if isinstance(engine, DPEngineClient):
            app[STATE].metrics.registry.register(DPCollector(engine))
        runner = GuardedAppRunner(
            app,
            opts.server.connection_limits,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=ABORT_GRACE_S,
        )
        # A signal during start-up (the engine may take minutes to load) stops cleanly.
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        assert main is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, main.cancel)
        try:
            await runner.setup()
        except EngineStartError as e:
            _say(f"the engine failed to start: {e}")
            await engine.shutdown(5.0)
            return 1
        except asyncio.CancelledError:
            _say("stopped during start-up")
            await engine.shutdown(5.0)
            return 0
        try:
            return await _run(opts, ddir, app, runner, engine)
        finally:
            await runner.cleanup()
    finally:
        ddir.remove()


def _engines(
    opts: DaemonOptions, ddir: DaemonDir, tel: str, ctl: str
) -> EngineClient | DPEngineClient:
    """The engine client: one engine process, or N behind a ``DPEngineClient``."""
    n = opts.data_parallel_size

    def client(rank: int, args: EngineArgs, kv_events: dict | None) -> EngineClient:
        suffix = f"-{rank}" if n > 1 else ""
        return EngineClient(
            EngineProcConfig(
                engine_args=args,
                engine_factory=opts.engine_factory,
                input_endpoint="",
                output_endpoint="",
                telemetry_endpoint=rank_endpoint(tel, rank),
                control_endpoint=rank_endpoint(ctl, rank),
                token_file=str(ddir.token_file),
                audit_file=str(ddir.audit_file),
                telemetry_hz=opts.telemetry_hz,
                telemetry_public=opts.telemetry_public,
                kv_events_config=kv_events,
                data_parallel_rank=rank,
            ),
            input_endpoint=ddir.endpoint(f"engine-in{suffix}"),
            output_endpoint=ddir.endpoint(f"engine-out{suffix}"),
        )

    if n == 1:
        return client(0, opts.engine_args, opts.kv_events_config)
    cuda = wants_cuda(opts.engine_args.device)
    engines, follow = [], []
    for rank in range(n):
        args = engine_args_for_rank(
            opts.engine_args, rank, n, cpu_threads=opts.dp_cpu_threads, cuda=cuda
        )
        private = None
        if opts.dp_routing == "prefix":
            private = (ddir.endpoint(f"kv-events-{rank}"), ddir.endpoint(f"kv-replay-{rank}"))
        kv_cfg, followed = kv_events_for_rank(opts.kv_events_config, rank, private)
        engines.append(client(rank, args, kv_cfg))
        follow.append(followed)
    return DPEngineClient(engines, RoutingPolicy(opts.dp_routing, opts.dp_max_skew), follow)


async def _run(
    opts: DaemonOptions, ddir: DaemonDir, app, runner, engine: EngineClient | DPEngineClient
) -> int:
    state = app[STATE]
    life = _Lifecycle(state, engine, opts.drain_timeout, opts.exit_on_engine_death)
    engine.on_dead.append(life.on_engine_dead)
    if isinstance(engine, DPEngineClient):
        engine.on_engine_dead.append(life.on_one_engine_dead)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, life.on_signal, sig.name)
    site = web.TCPSite(runner, opts.host, opts.port, shutdown_timeout=ABORT_GRACE_S)
    try:
        await site.start()
    except OSError as e:
        _say(f"cannot listen on {opts.host}:{opts.port}: {e.strerror or e}")
        return 1
    port = runner.addresses[0][1] if runner.addresses else opts.port
    host = f"[{opts.host}]" if ":" in opts.host else opts.host
    url = f"http://{host}:{port}"
    ready = state.engine_ready
    ddir.write_runtime(
        RuntimeInfo(
            pid=os.getpid(),
            start_time=time.time(),
            model=state.model.served_model_name,
            http_url=url,
            telemetry_endpoint=ready.telemetry_endpoint,
            control_endpoint=ready.control_endpoint,
            token_file=str(ddir.token_file),
            tp_size=ready.model_info.tp_size,
            audit_file=str(ddir.audit_file),
            tokenizer_path=ready.tokenizer_path or "",
            engines=_endpoints(engine),
            telemetry_auth=server_mode(ready.telemetry_endpoint, opts.telemetry_public),
        )
    )
    _say(f"serving {state.model.served_model_name} at {url} (runtime file: {ddir.runtime_file})")
    if isinstance(engine, DPEngineClient):  # died between handshake and now
        for i, one in enumerate(engine.engines):
            if one.dead is not None:
                life.on_one_engine_dead(i, one.dead)
    if engine.dead is not None:
        life.on_engine_dead(engine.dead)
    await life.stop.wait()
    with contextlib.suppress(OSError):
        ddir.runtime_file.unlink()  # finders stop seeing us before the slow part of exit
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
    return life.exit_code


def _endpoints(engine: EngineClient | DPEngineClient) -> list[EngineEndpoints]:
    if not isinstance(engine, DPEngineClient):
        return []
    out = []
    for i, e in enumerate(engine.engines):
        assert e.ready is not None
        out.append(
            EngineEndpoints(
                index=i,
                telemetry_endpoint=e.ready.telemetry_endpoint,
                control_endpoint=e.ready.control_endpoint,
            )
        )
    return out


def run(opts: DaemonOptions) -> int:
    logging.basicConfig(
        level=opts.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    return asyncio.run(serve(opts))
