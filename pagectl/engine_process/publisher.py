"""The telemetry publisher: a thread that owns the PUB socket, so liveness does not depend on
step length.

The engine loop builds and encodes snapshots between steps and hands the newest to
``publish`` (never blocking; an unsent older one is replaced). The thread sends it. When
nothing was sent for ``heartbeat_interval`` seconds, because the engine is inside a long step
or has nothing new, the thread sends a ``Heartbeat`` saying how long the current step has
run, so a console tells "busy in a step for 12 s" from "daemon gone".

Invariants:
- Only this thread touches the PUB socket once ``start`` ran (handed over under a lock,
  which is the memory barrier ZMQ asks for when a socket changes threads).
- Sends use NOBLOCK: a slow or absent subscriber drops frames, never holds the engine.
- The loop's side (``publish``, ``step_started``, ``step_finished``) takes one lock for a
  few attribute writes, or writes one attribute: cheap on the hot path.
"""

from __future__ import annotations

import contextlib
import threading
import time

import zmq

from pagectl.engine.telemetry import Heartbeat, encode_heartbeat


class TelemetryPublisher:
    """Sends snapshots handed over by the engine loop, and heartbeats in between."""

    def __init__(self, sock: zmq.Socket, heartbeat_interval: float = 0.5) -> None:
        self.sock = sock
        self.heartbeat_interval = heartbeat_interval
        self._cond = threading.Condition()
        self._pending: bytes | None = None
        self._pending_seq = 0
        self._last_seq = 0
        self._stop = False
        # Written by the loop thread: monotonic time the current step began (None: between
        # steps) and its id.
        self.busy_since: float | None = None
        self.busy_step = 0
        self.num_heartbeats = 0
        self.num_snapshots = 0
        self._thread = threading.Thread(target=self._run, name="telemetry-pub", daemon=True)

    def start(self) -> TelemetryPublisher:
        self._thread.start()
        return self

    # -- the loop's side ------------------------------------------------------------------

    def publish(self, frame: bytes, seq: int) -> None:
        with self._cond:
            self._pending = frame
            self._pending_seq = seq
            self._cond.notify()

    def step_started(self, step_id: int) -> None:
        self.busy_step = step_id
        self.busy_since = time.monotonic()

    def step_finished(self) -> None:
        self.busy_since = None

    def close(self, timeout: float = 1.0) -> None:
        """Send what is pending, stop the thread (the caller closes the socket after)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the thread ---------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        with contextlib.suppress(zmq.Again, zmq.ZMQError):
            self.sock.send(data, zmq.NOBLOCK)

    def _run(self) -> None:
        last_sent = time.monotonic()
        while True:
            with self._cond:
                if self._pending is None and not self._stop:
                    wait = last_sent + self.heartbeat_interval - time.monotonic()
                    if wait > 0:
                        self._cond.wait(wait)
                frame, self._pending = self._pending, None
                seq, stop = self._pending_seq, self._stop
            if frame is not None:
                self._send(frame)
                self._last_seq = seq
                self.num_snapshots += 1
                last_sent = time.monotonic()
            elif not stop and time.monotonic() - last_sent >= self.heartbeat_interval:
                since = self.busy_since
                now = time.monotonic()
                hb = Heartbeat(
                    "hb",
                    time.time(),
                    self._last_seq,
                    0.0 if since is None else max(0.0, now - since),
                    self.busy_step if since is not None else 0,
                )
                self._send(encode_heartbeat(hb))
                self.num_heartbeats += 1
                last_sent = now
            if stop:
                return
