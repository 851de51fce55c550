"""The admin channel's client, shared by ``pagectl ctl``, ``pagectl top`` and scripts.

    from pagectl.control.client import AdminClient, TelemetrySubscriber, find_runtime
    from pagectl.engine.commands import SetConfig

    info = find_runtime()                       # or find_runtime("/path/to/runtime/dir")
    with AdminClient.from_runtime(info) as admin:
        admin.command(SetConfig("max_num_batched_tokens", 4096))   # -> {"name", "old", "new"}
    with TelemetrySubscriber.for_runtime(info) as sub:  # presents the token if asked
        snap = sub.recv(timeout=1.0)            # TelemetrySnapshot or None

One request/reply core, ``AsyncAdminClient`` (asyncio, used by the console); ``AdminClient``
is its blocking wrapper (for ``ctl`` and scripts). Every failure is an ``AdminError``. Neither
is thread-safe: one instance per thread. The wire format is documented in
docs/ADMIN_PROTOCOL.md.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pagectl.control.protocol import ControlRequest, RuntimeInfo, decode_reply, encode
from pagectl.control.runtime import RuntimeNotFound, find_runtime, read_token
from pagectl.control.telemetry_auth import present_token, subscriber_token
from pagectl.engine.commands import Command, CommandError
from pagectl.engine.telemetry import TelemetrySnapshot, decode_snapshot, is_heartbeat

__all__ = [
    "AdminClient",
    "AdminError",
    "AsyncAdminClient",
    "RuntimeInfo",
    "RuntimeNotFound",
    "TelemetrySubscriber",
    "find_runtime",
    "read_token",
]


class AdminError(CommandError):
    """A command the daemon refused, or that got no answer.

    ``kind`` is the daemon's error kind (``invalid_value``, ``unknown_setting``,
    ``unknown_command``, ``not_found``, ``unauthorized``, ``bad_request``, ``internal``) or,
    raised on the client side, ``timeout`` (no reply in time) or ``no_token`` (the client
    has no control token: read-only). A ``CommandError``, so the console handles it as the
    refusals of its other sources.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(kind, message)
        self.args = (f"{kind}: {message}",)

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


def default_client_name(role: str = "client") -> str:
    return f"{role}@{socket.gethostname()}:{os.getpid()}"


class AsyncAdminClient:
    """Request/reply over a DEALER socket to the daemon's control ROUTER (asyncio).

    Replies are matched by request id (a late reply to a timed-out request is skipped).
    After a timeout the socket is dropped, so that a request still queued in it is never
    delivered later; the next command connects a new one.

    Args:
        control_endpoint: the daemon's control endpoint (``RuntimeInfo.control_endpoint``).
        token: the control token; None makes every command fail with ``no_token``.
        client_name: recorded in the daemon's audit log (default ``client@host:pid``).
        context: the zmq.asyncio.Context to use (default: the process-wide instance).
    """

    def __init__(
        self,
        control_endpoint: str,
        token: str | None,
        *,
        client_name: str | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.endpoint = control_endpoint
        self.token = token
        self.client_name = client_name or default_client_name()
        self._ids = itertools.count(1)
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        # One command in flight at a time: one DEALER recv at a time.
        self._lock = asyncio.Lock()

    @property
    def read_only(self) -> bool:
        return self.token is None

    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    async def command(self, cmd: Command, timeout: float = 5.0) -> dict:
        """Send one command and wait for its reply.

        Returns:
            The command's result dict (e.g. ``{"name", "old", "new"}`` for SetConfig).
        Raises:
            AdminError: refused by the daemon, no token, or no reply within ``timeout``.
        """
        if self.token is None:
            raise AdminError("no_token", "no control token: this client is read-only")
        async with self._lock:
            sock = self._socket()
            req_id = next(self._ids)
            req = ControlRequest(id=req_id, token=self.token, client=self.client_name, command=cmd)
            deadline = time.monotonic() + timeout
            try:
                await asyncio.wait_for(sock.send(encode(req)), timeout)
                while (left := deadline - time.monotonic()) > 0:
                    if not await sock.poll(int(left * 1000) + 1):
                        break
                    try:
                        reply = decode_reply(await sock.recv())
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        continue
                    if reply.id != req_id:
                        continue  # a late reply to an earlier, timed-out request
                    if reply.ok:
                        return reply.result or {}
                    err = reply.error
                    raise AdminError(
                        err.kind if err else "internal", err.message if err else "refused"
                    )
            except asyncio.TimeoutError:
                pass
            self.close()
            raise AdminError(
                "timeout", f"no reply from the daemon at {self.endpoint} within {timeout:g}s"
            )

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


class AdminClient:
    """The blocking wrapper of ``AsyncAdminClient`` (same arguments; ``context`` is a plain
    zmq.Context, default the process-wide instance). Runs each command on a private event
    loop, so it must not be called from inside a running one (use ``AsyncAdminClient``)."""

    def __init__(
        self,
        control_endpoint: str,
        token: str | None,
        *,
        client_name: str | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._ctx = zmq.asyncio.Context.shadow(context or zmq.Context.instance())
        self._core = AsyncAdminClient(
            control_endpoint, token, client_name=client_name, context=self._ctx
        )

    @classmethod
    def from_runtime(cls, info: RuntimeInfo, **kw) -> AdminClient:
        """A client for the daemon described by ``info`` (token read from its token file)."""
        return cls(info.control_endpoint, read_token(info.token_file), **kw)

    @property
    def endpoint(self) -> str:
        return self._core.endpoint

    @property
    def token(self) -> str | None:
        return self._core.token

    @property
    def client_name(self) -> str:
        return self._core.client_name

    @property
    def read_only(self) -> bool:
        return self._core.read_only

    def command(self, cmd: Command, timeout: float = 5.0) -> dict:
        """``AsyncAdminClient.command``, blocking."""
        return self._loop.run_until_complete(self._core.command(cmd, timeout))

    def close(self) -> None:
        self._core.close()
        self._loop.close()

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
        token: the control token, presented to a daemon whose telemetry asks for it
            (``control.telemetry_auth``; ``for_runtime`` decides); None presents nothing.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        conflate: bool = True,
        context: zmq.Context | None = None,
        token: str | None = None,
    ):
        self.endpoint = endpoint
        ctx = context or zmq.Context.instance()
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        if token is not None:
            present_token(self._sock, token)
        if conflate:
            self._sock.setsockopt(zmq.CONFLATE, 1)  # must precede connect
        else:
            self._sock.setsockopt(zmq.RCVHWM, 64)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)

    @classmethod
    def for_runtime(cls, info: RuntimeInfo, **kw: Any) -> TelemetrySubscriber:
        """A subscriber of the daemon described by ``info``, with the token if it asks."""
        token = subscriber_token(info.telemetry_endpoint, info.token_file, info.telemetry_auth)
        return cls(info.telemetry_endpoint, token=token, **kw)

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
