"""The engine process's loop: one thread owns the EngineCore and every socket.

Each turn: read what the API server sent (new requests, aborts, stop strings), serve queued
control requests, run one ``EngineCore.step()`` when there is work, and publish telemetry
when due. Control commands are therefore applied between steps, never inside one.

Invariants:
- Nothing a client or the API server sends can raise out of the loop: every frame is
  decoded with a size bound and a typed decoder (``frames.decode_frame``); a bad request
  fails alone (``RequestFailed``), a bad control request gets an error reply, and an
  unexpected exception while handling one message is logged with its traceback and costs
  that message only. Only an ``AssertionError`` (an engine invariant that broke) is fatal.
- Publishing never blocks: the loop hands encoded snapshots to the publisher thread
  (``publisher.py``), which owns the PUB socket, sends with NOBLOCK (PUB drops at its small
  high-water mark) and sends heartbeats while a step runs long. A slow or dead console
  cannot slow the engine, and a long step does not look like a dead daemon.
- An exception inside ``step()`` is fatal: the engine reports ``dead`` (to the API server
  and in a last snapshot) and the loop returns non-zero. So is a failed health check of the
  model executor (``executor.check_health()``, when it has one: a tensor-parallel worker that
  died while the engine was idle), run every turn.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from typing import Any

import msgspec
import zmq

from pagectl.engine.core import EngineCore
from pagectl.engine.telemetry import TelemetrySnapshot, encode_snapshot
from pagectl.engine_process import wire
from pagectl.engine_process.audit import AuditLog
from pagectl.engine_process.control_handler import handle_control
from pagectl.engine_process.frames import (
    MAX_INPUT_FRAME_BYTES,
    FrameError,
    decode_frame,
    submit_request_id,
)
from pagectl.engine_process.kv_events import KVEventPublisher
from pagectl.engine_process.native_memory import IdleTrim
from pagectl.engine_process.publisher import TelemetryPublisher

log = logging.getLogger("pagectl.engine")

# At most this many messages of each kind are taken per turn, so a flood of requests or
# control messages cannot starve the step.
_MAX_MESSAGES_PER_TURN = 256


def engine_stats(snap: TelemetrySnapshot) -> wire.EngineStats:
    """The compact figures the API server needs for /metrics, read from a snapshot (so
    /metrics and the consoles see the same instant, computed once)."""
    blocks = snap.blocks
    return wire.EngineStats(
        engine_state=snap.engine_state,
        num_running=snap.num_running,
        num_waiting=snap.num_waiting,
        num_blocks=blocks.num_blocks,
        num_used_blocks=snap.num_used_blocks,
        num_cached_free_blocks=snap.num_cached_free_blocks,
        num_token_slots=blocks.num_blocks * blocks.block_size,
        num_used_token_slots=snap.num_used_token_slots,
        counters=snap.counters,
        config=snap.config,
    )


def send_until_stopped(sock: zmq.Socket, data: bytes, stop: threading.Event) -> None:
    """Send on a PUSH socket that has a send timeout: wait while the reader's queue is full
    (back-pressure on a live reader), drop the message once ``stop`` is set (the reader, our
    parent, is gone), so a gone API server never holds the engine."""
    while not stop.is_set():
        try:
            sock.send(data)
            return
        except zmq.Again:
            continue


class EngineLoop:
    """Drives an ``EngineCore`` from ZMQ sockets (see module docstring).

    Args:
        core: the EngineCore.
        input_sock: PULL, ``wire.ToEngine`` frames from the API server.
        output_sock: PUSH, ``wire.FromEngine`` frames to the API server.
        pub_sock: PUB, telemetry snapshots (one frame each).
        control_sock: ROUTER, ``protocol.ControlRequest`` frames.
        token: the control token.
        telemetry_interval: seconds between snapshots (and stats messages).
        stop_event: set by another thread (parent death) to make the loop return.
        kv_events: the KV-event publisher (``--kv-events-config``), or None. The step's
            events are handed to it once per turn, after the step and the control commands.
        audit: where control commands are recorded (None: nowhere).
        idle_trim: hands freed native memory back once the engine has been idle a while
            (``native_memory.IdleTrim``; None: never).
    """

    def __init__(
        self,
        core: EngineCore,
        *,
        input_sock: zmq.Socket,
        output_sock: zmq.Socket,
        pub_sock: zmq.Socket | None,
        control_sock: zmq.Socket | None,
        token: str,
        telemetry_interval: float = 0.1,
        stop_event: threading.Event | None = None,
        kv_events: KVEventPublisher | None = None,
        audit: AuditLog | None = None,
        idle_trim: IdleTrim | None = None,
    ) -> None:
        self.core = core
        self.idle_trim = idle_trim
        self.audit = audit
        self.publisher = TelemetryPublisher(pub_sock) if pub_sock is not None else None
        self.input_sock = input_sock
        self.output_sock = output_sock
        self.pub_sock = pub_sock
        self.control_sock = control_sock
        self.token = token
        self.telemetry_interval = telemetry_interval
        self.stop_event = stop_event or threading.Event()
        self.kv_events = kv_events
        if kv_events is not None:
            core.enable_kv_events()
        self._next_publish = 0.0
        self._shutdown = False
        self.poller = zmq.Poller()
        self.poller.register(input_sock, zmq.POLLIN)
        if control_sock is not None:
            self.poller.register(control_sock, zmq.POLLIN)

    # -- sending ------------------------------------------------------------------------

    def _send(self, msg: msgspec.Struct) -> None:
        send_until_stopped(self.output_sock, wire.encode(msg), self.stop_event)

    def publish(self) -> None:
        snap = self.core.snapshot()
        if self.publisher is not None:
            self.publisher.publish(encode_snapshot(snap), snap.seq)
        stats = engine_stats(snap)
        if self.kv_events is not None:
            stats.kv_events_published = self.kv_events.num_published
            stats.kv_events_dropped = self.kv_events.num_dropped
        self._send(stats)
        self._next_publish = time.monotonic() + self.telemetry_interval

    # -- inputs -------------------------------------------------------------------------

    def _handle_input(self, frame: bytes) -> None:
        try:
            msg = decode_frame(wire.to_engine_decoder, frame, MAX_INPUT_FRAME_BYTES)
        except FrameError as e:
            # Only our own API server writes here, so this is a bug or a foreign writer:
            # logged, answered when it names a request, never raised into the loop.
            rid = submit_request_id(frame)
            log.warning("dropped a malformed input frame (%d bytes): %s", len(frame), e)
            if rid is not None:
                self._send(wire.RequestFailed(rid, f"malformed request frame: {e}"))
            return
        core = self.core
        if isinstance(msg, wire.SubmitRequest):
            rid = msg.request.request_id
            try:
                core.add_engine_request(msg.request)
            except AssertionError:
                raise  # an invariant of the engine broke: fatal (see run)
            except Exception as e:  # any refusal fails this request only
                self._send(wire.RequestFailed(rid, str(e) or type(e).__name__))
        elif isinstance(msg, wire.AbortRequests):
            for rid in msg.request_ids:
                core.abort_request(rid)
        elif isinstance(msg, wire.FinishStopString):
            core.finish_by_stop_string(msg.request_id, msg.index, msg.stop)
        elif isinstance(msg, wire.SetDraining):
            core.state_override = "draining" if msg.draining else None
            self._next_publish = 0.0
        elif isinstance(msg, wire.Shutdown):
            self._shutdown = True

    def _guarded(self, what: str, fn: Any, *args: Any) -> None:
        """Run the handling of one message; an unexpected exception is logged with its
        traceback and costs that message only. ``AssertionError`` (an engine invariant that
        broke) propagates: the loop dies on it."""
        try:
            fn(*args)
        except AssertionError:
            raise
        except Exception:
            log.exception("handling %s failed; the engine goes on", what)

    def _drain_inputs(self) -> None:
        for _ in range(_MAX_MESSAGES_PER_TURN):
            try:
                frame = self.input_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._guarded("an input message", self._handle_input, frame)
            if self._shutdown:
                return

    def _serve_control(self) -> None:
        sock = self.control_sock
        if sock is None:
            return
        for _ in range(_MAX_MESSAGES_PER_TURN):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue  # a DEALER sends exactly one frame; ROUTER adds the identity
            self._guarded("a control request", self._control_one, sock, *frames)

    def _control_one(self, sock: zmq.Socket, ident: zmq.Frame, frame: zmq.Frame) -> None:
        try:  # ipc: "host:uid:gid:pid" from the kernel's peer credentials
            peer = frame.get("Peer-Address")
        except zmq.ZMQError:
            peer = None
        reply, changed = handle_control(
            self.core,
            self.token,
            frame.bytes,
            peer_address=peer if isinstance(peer, str) else None,
            audit=self.audit,
        )
        # A client that left, or whose queue is full, loses its reply.
        with contextlib.suppress(zmq.ZMQError):
            sock.send_multipart([ident.bytes, reply], zmq.NOBLOCK)
        if changed:
            self._next_publish = 0.0  # consoles see the change at once

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> int:
        """Loop until Shutdown (returns 0), parent death (0) or a fatal step error (1)."""
        if self.publisher is not None:
            self.publisher.start()
        try:
            return self._run()
        finally:
            if self.publisher is not None:
                self.publisher.close()

    def _run(self) -> int:
        core = self.core
        publisher = self.publisher
        check_health = getattr(getattr(core, "executor", None), "check_health", None)
        idle_trim = self.idle_trim
        while not self._shutdown and not self.stop_event.is_set():
            if check_health is not None:
                try:
                    check_health()
                except Exception as e:  # fatal: report and stop
                    return self._die(e, "engine failed")
            # Busy: only peek at the sockets. Idle: sleep in poll until a message arrives or
            # the next snapshot is due.
            timeout_ms = 0
            if not core.has_unfinished():
                wait = self._next_publish - time.monotonic()
                if idle_trim is not None:
                    idle_trim.idle()  # at most once per idle period, never while busy
                timeout_ms = math.ceil(min(max(wait, 0.0), 0.1) * 1000)
            try:
                if self.poller.poll(timeout_ms):
                    self._drain_inputs()
                    self._serve_control()
            except AssertionError as e:  # an engine invariant broke: fatal
                return self._die(e, "engine invariant failed")
            if self._shutdown:
                break
            if core.has_unfinished():
                if publisher is not None:
                    publisher.step_started(core.counters.steps + 1)
                try:
                    outputs = core.step()
                except Exception as e:  # fatal: report and stop
                    return self._die(e)
                finally:
                    if publisher is not None:
                        publisher.step_finished()
                if idle_trim is not None:
                    idle_trim.busy()
                if outputs:
                    self._send(wire.OutputBatch(outputs))
                if not core.has_unfinished():
                    self._next_publish = 0.0  # idle now: /metrics and consoles see it at once
            if self.kv_events is not None:
                events = core.take_kv_events()  # one batch per turn, handed over, never sent here
                if events:
                    self.kv_events.publish(events)
            if time.monotonic() >= self._next_publish:
                try:
                    self.publish()
                except Exception as e:  # a snapshot that cannot be built is an engine bug
                    return self._die(e, "telemetry failed")
        return 0

    def _die(self, exc: BaseException, what: str = "engine step failed") -> int:
        message = f"{what}: {type(exc).__name__}: {exc}"
        log.error("%s", message, exc_info=exc)
        self.core.state_override = "dead"
        self.core.add_event("error", message)
        with contextlib.suppress(Exception):  # best effort while dying
            self.publish()
        self._send(wire.EngineDead(message))
        return 1
