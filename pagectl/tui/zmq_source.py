"""The live ``AdminSource``: a daemon's admin channel over ZMQ (see ``pagectl.control.protocol``).

Telemetry: a SUB socket with ZMQ_CONFLATE, so only the newest snapshot is ever queued and a
slow console drops frames instead of falling behind. Control: the admin channel's client
(``pagectl.control.client.AsyncAdminClient``) with the token from the daemon's token file.

Reconnection: when no telemetry arrives for ``reconnect_after`` seconds, the sockets are
rebuilt, re-reading the runtime file (a restarted daemon may have new endpoints) and the
token file (a restarted daemon writes a new token). ZMQ itself also reconnects a socket whose
peer comes back on the same endpoint.

Threading: every method runs on the app's event loop (zmq.asyncio); commands are serialised
by a lock so that one DEALER recv is in flight at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from pagectl.control.client import AdminError, AsyncAdminClient, default_client_name
from pagectl.control.runtime import read_token_file
from pagectl.control.telemetry_auth import present_token, subscriber_token
from pagectl.engine.commands import Command
from pagectl.tui.source import Frame


@dataclass(frozen=True)
class Endpoints:
    """Where a daemon's admin channel listens."""

    telemetry: str
    # None: read-only.
    control: str | None
    # The 0600 file holding the control token; None: read-only.
    token_file: str | None
    # The daemon's HTTP address, shown in the header ("" when attached by endpoints alone).
    http_url: str = ""
    # The runtime file's ``telemetry_auth`` (None when attached by endpoints alone: the
    # token is presented where other users could connect; ``control.telemetry_auth``).
    telemetry_auth: str | None = None


# Returns the endpoints of the daemon to attach to, or raises with a message for the header.
Resolver = Callable[[], Endpoints]


def runtime_resolver(runtime_dir: str | None) -> Resolver:
    """Find the daemon through its runtime file (``pagectl.control.client.find_runtime``)."""

    def resolve() -> Endpoints:
        from pagectl.control.client import find_runtime

        info = find_runtime(runtime_dir)
        return Endpoints(
            info.telemetry_endpoint,
            info.control_endpoint,
            info.token_file,
            telemetry_auth=info.telemetry_auth,
        )

    return resolve


class ZmqSource:
    """An ``AdminSource`` attached to a daemon's admin sockets."""

    def __init__(
        self,
        resolver: Resolver | Endpoints,
        *,
        client_name: str | None = None,
        command_timeout: float = 5.0,
        reconnect_after: float = 3.0,
    ) -> None:
        if isinstance(resolver, Endpoints):
            fixed = resolver
            resolver = lambda: fixed  # noqa: E731
        self._resolve = resolver
        self.client_name = client_name or default_client_name("top")
        self.command_timeout = command_timeout
        self.reconnect_after = reconnect_after
        self.label = "zmq"
        # Why nothing is connected (no daemon found, ...); "" when attached.
        self.detail = ""
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._admin: AsyncAdminClient | None = None
        self._endpoints: Endpoints | None = None
        self._token: str | None = None
        self._read_only_reason = "not connected"
        self._last_activity = 0.0
        # Held by a command in flight and by a reconnect, so neither disturbs the other.
        self._lock = asyncio.Lock()
        self.num_reconnects = 0

    @property
    def can_control(self) -> bool:
        return self._token is not None

    @property
    def read_only_reason(self) -> str:
        return "" if self._token is not None else self._read_only_reason

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._connect()

    def _connect(self) -> None:
        """(Re)build both sockets from a fresh look at the runtime and token files."""
        assert self._ctx is not None
        self._close_sockets()
        self._last_activity = time.monotonic()
        try:
            ep = self._resolve()
        except Exception as e:  # no daemon yet, unreadable runtime file, ...
            self._endpoints = None
            self.detail = str(e) or type(e).__name__
            self._token = None
            self._read_only_reason = "not connected"
            return
        self._endpoints = ep
        self.label = ep.http_url or ep.telemetry
        self.detail = ""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.CONFLATE, 1)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub_token = subscriber_token(ep.telemetry, ep.token_file, ep.telemetry_auth)
        if sub_token is not None:
            present_token(sub, sub_token)
        sub.connect(ep.telemetry)
        self._sub = sub
        if ep.control is None:
            self._token, self._read_only_reason = None, "no control endpoint"
        else:
            self._token, self._read_only_reason = read_token_file(ep.token_file)
            if self._token is not None:
                self._admin = AsyncAdminClient(
                    ep.control, self._token, client_name=self.client_name, context=self._ctx
                )

    def _close_sockets(self) -> None:
        if self._sub is not None:
            self._sub.close(linger=0)
        if self._admin is not None:
            self._admin.close()
        self._sub = None
        self._admin = None

    async def next_frame(self, timeout: float) -> Frame | None:
        sub = self._sub
        if sub is not None and await sub.poll(int(timeout * 1000)):
            data = await sub.recv(copy=True)
            self._last_activity = time.monotonic()
            return Frame(data, time.time())
        if sub is None:
            await asyncio.sleep(timeout)
        if time.monotonic() - self._last_activity >= self.reconnect_after:
            self.num_reconnects += 1
            async with self._lock:  # never rebuild the client under a command in flight
                self._connect()
        return None

    async def send(self, command: Command) -> dict:
        async with self._lock:
            admin = self._admin  # read under the lock: a reconnect may have replaced it
            if self._token is None or admin is None:
                raise AdminError("unauthorized", f"read-only: {self.read_only_reason}")
            return await admin.command(command, self.command_timeout)

    async def close(self) -> None:
        self._close_sockets()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
