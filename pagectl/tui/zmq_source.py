"""The live ``AdminSource``: a daemon's admin channel over ZMQ (see ``pagectl.control.protocol``).

Telemetry: a SUB socket with ZMQ_CONFLATE, so only the newest snapshot is ever queued and a
slow console drops frames instead of falling behind. Control: a DEALER socket sending
``ControlRequest`` frames with the token from the daemon's token file; replies are matched
by id, with a timeout.

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

from pagectl.control.client import default_client_name
from pagectl.control.protocol import ControlRequest, decode_reply, encode
from pagectl.engine.commands import Command, CommandError
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


# Returns the endpoints of the daemon to attach to, or raises with a message for the header.
Resolver = Callable[[], Endpoints]


def runtime_resolver(runtime_dir: str | None) -> Resolver:
    """Find the daemon through its runtime file (``pagectl.control.client.find_runtime``)."""

    def resolve() -> Endpoints:
        from pagectl.control.client import find_runtime

        info = find_runtime(runtime_dir)
        return Endpoints(info.telemetry_endpoint, info.control_endpoint, info.token_file)

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
        self._dealer: zmq.asyncio.Socket | None = None
        self._endpoints: Endpoints | None = None
        self._token: str | None = None
        self._read_only_reason = "not connected"
        self._last_activity = 0.0
        self._next_id = 0
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
        sub.connect(ep.telemetry)
        self._sub = sub
        if ep.control is None:
            self._token, self._read_only_reason = None, "no control endpoint"
        else:
            self._token, self._read_only_reason = _read_token(ep.token_file)

    def _close_sockets(self) -> None:
        for s in (self._sub, self._dealer):
            if s is not None:
                s.close(linger=0)
        self._sub = None
        self._dealer = None

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
            async with self._lock:  # never rebuild the DEALER under a command in flight
                self._connect()
        return None

    async def send(self, command: Command) -> dict:
        if self._token is None or self._endpoints is None or self._endpoints.control is None:
            raise CommandError("unauthorized", f"read-only: {self.read_only_reason}")
        async with self._lock:
            assert self._ctx is not None
            if self._dealer is None:
                dealer = self._ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(self._endpoints.control)
                self._dealer = dealer
            dealer = self._dealer
            self._next_id += 1
            req = ControlRequest(
                id=self._next_id, token=self._token, client=self.client_name, command=command
            )
            deadline = time.monotonic() + self.command_timeout
            try:
                await asyncio.wait_for(dealer.send(encode(req)), self.command_timeout)
                while (remaining := deadline - time.monotonic()) > 0:
                    if not await dealer.poll(int(remaining * 1000)):
                        break
                    reply = decode_reply(await dealer.recv())
                    if reply.id != req.id:
                        continue  # a late answer to a command that already timed out
                    if reply.ok:
                        return reply.result or {}
                    err = reply.error
                    raise CommandError(err.kind if err else "error", err.message if err else "")
            except asyncio.TimeoutError:
                pass
            # No answer: drop the socket so that a queued request is not delivered later.
            dealer.close(linger=0)
            self._dealer = None
            raise CommandError(
                "timeout", f"no answer from the daemon within {self.command_timeout:g} s"
            )

    async def close(self) -> None:
        self._close_sockets()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


def _read_token(path: str | None) -> tuple[str | None, str]:
    """(token, reason for read-only mode)."""
    if not path:
        return None, "no control token file"
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        return None, f"cannot read the control token ({e.strerror}: {path})"
    if not token:
        return None, f"the control token file {path} is empty"
    return token, ""
