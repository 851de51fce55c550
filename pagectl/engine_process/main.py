"""The engine-core process: ``python -m pagectl.engine_process.main``, started by the daemon.

The parent writes one JSON line (``EngineProcConfig``) to our stdin and keeps the pipe open
for as long as it lives. End of file on stdin means the parent is gone: the loop stops and
the process exits by itself (forcibly after ``_ORPHAN_GRACE_S`` if a step hangs).

SIGINT is ignored: Ctrl-C in a terminal reaches the whole process group, and shutting the
engine down is the daemon's job (it drains first, then sends ``Shutdown``).
"""

from __future__ import annotations

import importlib
import os
import signal
import threading
import time
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import zmq

from pagectl.control import ipc
from pagectl.control.runtime import read_token
from pagectl.control.telemetry_auth import PLAIN, TelemetryAuth, server_mode
from pagectl.engine.args import EngineArgs
from pagectl.engine_process import native_memory, wire
from pagectl.engine_process.frames import (
    MAX_CONTROL_FRAME_BYTES,
    MAX_INPUT_FRAME_BYTES,
    limit_socket,
)

if TYPE_CHECKING:
    from pagectl.engine.core import EngineCore
from pagectl.engine_process.audit import AuditLog

_ORPHAN_GRACE_S = 5.0
# Small on purpose: a console that falls behind loses snapshots, the engine never waits.
TELEMETRY_SNDHWM = 2


class Built(Protocol):
    """What the engine process and the in-process test engine need of a built engine:
    ``pagectl.engine.builder.BuiltEngine``, or what an ``--engine-factory`` returns."""

    @property
    def core(self) -> EngineCore: ...
    @property
    def tokenizer(self) -> Any | None: ...
    @property
    def model_name(self) -> str: ...
    @property
    def model_path(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def eos_token_ids(self) -> Sequence[int]: ...
    @property
    def sampling_defaults(self) -> dict[str, Any]: ...
    def shutdown(self) -> None: ...


class EngineProcConfig(msgspec.Struct, kw_only=True):
    """What the daemon tells its engine process (JSON, one line on stdin)."""

    # The engine's start-up options (validated again when decoded).
    engine_args: EngineArgs
    # "module:function" building the engine from EngineArgs instead of
    # ``pagectl.engine.builder.build_engine`` (tests use it for fault injection).
    engine_factory: str | None = None
    # Internal sockets, bound by the API server.
    input_endpoint: str
    output_endpoint: str
    # Admin sockets, bound here.
    telemetry_endpoint: str
    control_endpoint: str
    token_file: str
    # The append-only JSON-lines audit file of control commands ("" keeps none).
    audit_file: str = ""
    telemetry_hz: float = 10.0
    # ``--telemetry-public``: no token asked of subscribers even where other local users can
    # connect (``control.telemetry_auth``).
    telemetry_public: bool = False
    # ``--kv-events-config`` (vLLM's KVEventsConfig fields, checked by the daemon), or None.
    kv_events_config: dict[str, Any] | None = None
    # This engine's data-parallel rank (0..N-1; 0 for a daemon of one engine): carried in
    # its KV-event batches.
    data_parallel_rank: int = 0


def _read_line(fd: int) -> bytes:
    # Raw reads, never sys.stdin: the watcher thread below must not hold the buffered
    # reader's lock when the interpreter shuts down.
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        data += chunk
    return data


def _watch_parent(stop: threading.Event) -> None:
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    stop.set()
    time.sleep(_ORPHAN_GRACE_S)
    os._exit(1)  # the loop did not stop in time (a hung step): leave anyway


def _load_factory(spec: str | None):
    if not spec:
        from pagectl.engine.builder import build_engine

        return build_engine
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _bind(sock: zmq.Socket, endpoint: str, claims: list[ipc.IpcClaim]) -> str:
    """Bind; an ipc:// path must be free or hold a dead socket of ours (``control.ipc``)."""
    ipc.claim(endpoint)
    sock.bind(endpoint)
    c = ipc.bound(endpoint)
    if c is not None:
        claims.append(c)  # removed at exit if still ours
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) else str(bound)


def engine_ready(
    built: Built,
    tokenizer: str | None = None,
    *,
    telemetry_endpoint: str = "",
    control_endpoint: str = "",
) -> wire.EngineReady:
    """The handshake describing ``built`` (a ``BuiltEngine``); ``tokenizer`` is where its
    tokenizer came from when not the model's directory."""
    core = built.core
    return wire.EngineReady(
        pid=os.getpid(),
        model_name=built.model_name,
        model_path=str(built.model_path),
        tokenizer_path=(tokenizer or str(built.model_path))
        if built.tokenizer is not None
        else None,
        vocab_size=built.vocab_size,
        max_model_len=built.max_model_len,
        eos_token_ids=list(built.eos_token_ids),
        sampling_defaults=dict(built.sampling_defaults),
        model_info=core.model_info,
        config=core.live_config(),
        telemetry_endpoint=telemetry_endpoint,
        control_endpoint=control_endpoint,
    )


def serve(cfg: EngineProcConfig, stop: threading.Event) -> int:
    from pagectl.engine_process.loop import EngineLoop, send_until_stopped

    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDTIMEO, 500)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(cfg.output_endpoint)
    inp = limit_socket(ctx.socket(zmq.PULL), MAX_INPUT_FRAME_BYTES)
    inp.setsockopt(zmq.LINGER, 0)
    inp.connect(cfg.input_endpoint)

    def send(msg: msgspec.Struct) -> None:
        send_until_stopped(out, wire.encode(msg), stop)

    built = None
    pub = router = None
    tel_auth = None
    kv_pub = None
    claims: list[ipc.IpcClaim] = []
    try:
        try:
            token = read_token(cfg.token_file)
            if not token:
                raise RuntimeError(f"cannot read the control token from {cfg.token_file}")
            args = cfg.engine_args
            built = _load_factory(cfg.engine_factory)(args)
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, TELEMETRY_SNDHWM)
            pub.setsockopt(zmq.LINGER, 0)
            if server_mode(cfg.telemetry_endpoint, cfg.telemetry_public) == PLAIN:
                tel_auth = TelemetryAuth(ctx, token)
                tel_auth.protect(pub)
            telemetry_ep = _bind(pub, cfg.telemetry_endpoint, claims)
            # Admin frames past the limit disconnect their sender (libzmq drops them).
            router = limit_socket(ctx.socket(zmq.ROUTER), MAX_CONTROL_FRAME_BYTES)
            router.setsockopt(zmq.LINGER, 0)
            control_ep = _bind(router, cfg.control_endpoint, claims)
            if cfg.kv_events_config is not None:
                from pagectl.engine_process.kv_events import KVEventPublisher, KVEventsConfig

                kv_cfg = msgspec.convert(cfg.kv_events_config, KVEventsConfig)
                if kv_cfg.active:
                    kv_pub = KVEventPublisher(
                        kv_cfg,
                        built.core.block_size,
                        data_parallel_rank=cfg.data_parallel_rank,
                        ctx=ctx,
                    )
        except Exception as e:  # report any start-up failure to the daemon
            traceback.print_exc()
            send(wire.EngineStartFailed(f"{type(e).__name__}: {e}"))
            return 1
        send(
            engine_ready(
                built,
                args.tokenizer,
                telemetry_endpoint=telemetry_ep,
                control_endpoint=control_ep,
            )
        )
        loop = EngineLoop(
            built.core,
            input_sock=inp,
            output_sock=out,
            pub_sock=pub,
            control_sock=router,
            token=token,
            telemetry_interval=1.0 / cfg.telemetry_hz,
            stop_event=stop,
            kv_events=kv_pub,
            audit=AuditLog(cfg.audit_file) if cfg.audit_file else None,
            idle_trim=native_memory.IdleTrim() if native_memory.enabled() else None,
        )
        return loop.run()
    finally:
        if kv_pub is not None:
            kv_pub.shutdown()
        if built is not None:
            try:
                built.shutdown()
            except Exception:  # still close the sockets
                traceback.print_exc()
        for s in (pub, router, inp):
            if s is not None:
                s.close(linger=0)
        for c in claims:
            ipc.release(c)
        if tel_auth is not None:
            tel_auth.stop()
        # Flush the last messages to a live parent; drop them for a dead one.
        out.close(linger=0 if stop.is_set() else 2000)
        ctx.term()


def main() -> int:
    native_memory.configure()  # before anything imports torch
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    line = _read_line(0)
    if not line:
        return 1
    cfg = msgspec.json.decode(line, type=EngineProcConfig)
    stop = threading.Event()
    threading.Thread(target=_watch_parent, args=(stop,), name="parent-watch", daemon=True).start()
    return serve(cfg, stop)


if __name__ == "__main__":
    raise SystemExit(main())
