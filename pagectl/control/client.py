"""A small client for the admin channel, shared by ``pagectl ctl`` and ``pagectl top``.

    from pagectl.control.client import AdminClient, TelemetrySubscriber, find_runtime
    from pagectl.engine.commands import SetConfig

    info = find_runtime()                       # or find_runtime("/path/to/runtime/dir")
    with AdminClient.from_runtime(info) as admin:
        admin.command(SetConfig("max_num_batched_tokens", 4096))   # -> {"name", "old", "new"}
    with TelemetrySubscriber(info.telemetry_endpoint) as sub:
        snap = sub.recv(timeout=1.0)            # TelemetrySnapshot or None

Both are blocking and not thread-safe: use one instance per thread (a console runs them in
worker threads). The wire format is documented in docs/ADMIN_PROTOCOL.md.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Iterator

import msgspec
import zmq

from pagectl.control.protocol import ControlRequest, RuntimeInfo, decode_reply, encode
from pagectl.control.runtime import RuntimeNotFound, find_runtime, read_token
from pagectl.engine.commands import Command
from pagectl.engine.telemetry import TelemetrySnapshot, decode_snapshot, is_heartbeat

__all__ = [
    "AdminClient",
    "AdminError",
    "RuntimeInfo",
    "RuntimeNotFound",
    "TelemetrySubscriber",
    "find_runtime",
    "read_token",
]


class AdminError(Exception):
    """A command the daemon refused, or that got no answer.

    ``kind`` is the daemon's error kind (``invalid_value``, ``unknown_setting``,
    ``unknown_command``, ``not_found``, ``unauthorized``, ``bad_request``, ``internal``) or,
    raised on the client side, ``timeout`` (no reply in time) or ``no_token`` (the client
    has no control token: read-only).
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


def default_client_name(role: str = "client") -> str:
    return f"{role}@{socket.gethostname()}:{os.getpid()}"


class AdminClient:
    """Request/reply over a DEALER socket to the daemon's control ROUTER.

    Args:
        control_endpoint: the daemon's control endpoint (``RuntimeInfo.control_endpoint``).
        token: the control token; None makes every command fail with ``no_token``.
        client_name: recorded in the daemon's audit log (default ``client@host:pid``).
        context: a zmq.Context to use (default: the process-wide instance).
    """

    def __init__(
        self,
        control_endpoint: str,
        token: str | None,
        *,
        client_name: str | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.endpoint = control_endpoint
        self.token = token
        self.client_name = client_name or default_client_name()
        self._ids = itertools.count(1)
        ctx = context or zmq.Context.instance()
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(control_endpoint)

    @classmethod
    def from_runtime(cls, info: RuntimeInfo, **kw) -> AdminClient:
        """A client for the daemon described by ``info`` (token read from its token file)."""
        return cls(info.control_endpoint, read_token(info.token_file), **kw)

    @property
    def read_only(self) -> bool:
        return self.token is None

    def command(self, cmd: Command, timeout: float = 5.0) -> dict:
        """Send one command and wait for its reply.

        Returns:
            The command's result dict (e.g. ``{"name", "old", "new"}`` for SetConfig).
        Raises:
            AdminError: refused by the daemon, no token, or no reply within ``timeout``.
        """
        if self.token is None:
            raise AdminError("no_token", "no control token: this client is read-only")
        req_id = next(self._ids)
        req = ControlRequest(id=req_id, token=self.token, client=self.client_name, command=cmd)
        self._sock.send(encode(req))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000) + 1):
                raise AdminError(
                    "timeout", f"no reply from the daemon at {self.endpoint} within {timeout:g}s"
                )
            try:
                reply = decode_reply(self._sock.recv())
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if reply.id != req_id:
                continue  # a late reply to an earlier, timed-out request
            if reply.ok:
                return reply.result or {}
            err = reply.error
            raise AdminError(err.kind if err else "internal", err.message if err else "refused")

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TelemetrySubscriber:
    """SUB socket on the daemon's telemetry PUB, keeping only the newest snapshot (CONFLATE).

    Args:
        endpoint: ``RuntimeInfo.telemetry_endpoint``.
        conflate: keep only the newest unread snapshot (default); False keeps a short queue
            (for recording every snapshot).
        context: a zmq.Context to use (default: the process-wide instance).
    """

    def __init__(self, endpoint: str, *, conflate: bool = True, context: zmq.Context | None = None):
        self.endpoint = endpoint
        ctx = context or zmq.Context.instance()
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        if conflate:
            self._sock.setsockopt(zmq.CONFLATE, 1)  # must precede connect
        else:
            self._sock.setsockopt(zmq.RCVHWM, 64)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)

    def recv_raw(self, timeout: float | None = None) -> bytes | None:
        """The next frame undecoded (a snapshot or a heartbeat, see
        ``telemetry.is_heartbeat``), or None after ``timeout``."""
        ms = -1 if timeout is None else int(timeout * 1000)
        if not self._sock.poll(ms):
            return None
        return self._sock.recv()

    def recv(self, timeout: float | None = None) -> TelemetrySnapshot | None:
        """The next snapshot, or None after ``timeout`` seconds (None: wait forever).

        Raises:
            ValueError: the snapshot has a newer major version than this client understands
                (or is not a snapshot).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            frame = self.recv_raw(left)
            if frame is None:
                return None
            if not is_heartbeat(frame):  # heartbeats say "alive" between snapshots
                break
        try:
            return decode_snapshot(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ValueError(f"not a telemetry snapshot: {e}") from None

    def __iter__(self) -> Iterator[TelemetrySnapshot]:
        while True:
            snap = self.recv()
            if snap is not None:
                yield snap

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> TelemetrySubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
