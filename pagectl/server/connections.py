"""Connection limits of the HTTP server: timeouts, a connection cap, errors in OpenAI's shape.

aiohttp alone let 300 silent or slowloris connections hold every file descriptor under
``ulimit -n 256`` for as long as the clients wished. ``GuardedAppRunner`` serves the app
with:

- a header timeout: a connection that has not sent a complete request head within
  ``header_timeout`` seconds of connecting is closed, however slowly it trickles bytes;
- a keep-alive idle timeout (aiohttp's ``keepalive_timeout``): between two requests a
  connection may stay silent, or send a partial head, for at most that long;
- a body timeout: ``server.body.read_body`` reads a body within ``body_timeout`` (408);
- a connection cap: past ``max_connections`` open connections, a new one makes room by
  closing the oldest connection that has no request in progress, else it is closed at once.
  The default cap leaves room under the process's file-descriptor limit, so accept() never
  fails with EMFILE and a fresh client always gets in.

Errors of aiohttp's own HTTP parser (bad request line, header too long) are answered in
OpenAI's error shape instead of plain text.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from pagectl.server.errors import APIError

log = logging.getLogger("pagectl.server")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_KEEPALIVE_TIMEOUT_S = 15.0
# File descriptors kept for everything but HTTP connections (sockets to the engine, the
# tokenizer's files, logs, the runtime dir).
_FD_RESERVE = 64


def default_max_connections() -> int:
    """Half the soft ``RLIMIT_NOFILE``, at most 4096 (and at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft // 2, soft - _FD_RESERVE))


@dataclass
class ConnectionLimits:
    """HTTP connection limits (``pagectl daemon`` flags of the same names)."""

    # Seconds from connect to a complete request head (--http-header-timeout).
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    # Seconds to receive a request body (--http-body-timeout); enforced in read_body.
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    # Seconds a connection may idle between requests (--http-keepalive-timeout).
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT_S
    # Most open HTTP connections (--max-connections; None: ``default_max_connections()``).
    max_connections: int | None = None


class _Registry:
    """Open connections, oldest first (event loop thread only)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: OrderedDict[GuardedRequestHandler, None] = OrderedDict()
        self.evicted = 0
        self.refused = 0

    def admit(self, new: GuardedRequestHandler) -> bool:
        """Make room for ``new``; False when every connection is busy with a request."""
        if len(self.open) < self.limit:
            self.open[new] = None
            return True
        for h in self.open:
            if h.idle:
                h.force_close()
                self.open.pop(h, None)
                self.evicted += 1
                self.open[new] = None
                return True
        self.refused += 1
        return False


class GuardedRequestHandler(RequestHandler):
    """aiohttp's connection handler with a header timeout, the cap, and JSON parser errors."""

    def __init__(self, manager: Server, *, registry: _Registry, header_timeout: float, **kw):
        super().__init__(manager, **kw)
        self._registry = registry
        self._header_timeout = header_timeout
        self._header_handle: asyncio.TimerHandle | None = None
        self._admitted = False

    @property
    def idle(self) -> bool:
        """No request is being handled on this connection."""
        return self._current_request is None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._registry.admit(self):
            transport.close()  # every slot busy with a request: this one cannot be served
            return
        self._admitted = True
        super().connection_made(transport)
        if self._header_timeout > 0:
            self._header_handle = self._loop.call_later(
                self._header_timeout, self._on_header_timeout
            )

    def _on_header_timeout(self) -> None:
        self._header_handle = None
        if self._request_count == 0:  # no complete request head yet: slow or silent
            self.force_close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._request_count and self._header_handle is not None:
            self._header_handle.cancel()
            self._header_handle = None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._registry.open.pop(self, None)
        if self._header_handle is not None:
            self._header_handle.cancel()
            self._header_handle = None
        if self._admitted:  # a refused connection never reached aiohttp
            super().connection_lost(exc)

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's parser errors and unhandled failures, in OpenAI's shape."""
        if status >= 500:
            log.error("error handling a request", exc_info=exc)
            message = "internal server error"
        if request.writer.output_size > 0:
            raise ConnectionError("the response has started; cannot send an error")
        resp = APIError(status, message or "bad request", code="bad_http_request").response()
        resp.force_close()
        return resp


class _GuardedServer(Server):
    registry: _Registry
    header_timeout: float

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(
            self,
            loop=self._loop,
            registry=self.registry,
            header_timeout=self.header_timeout,
            **self._kwargs,
        )


class GuardedAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections follow ``limits``."""

    def __init__(self, app: web.Application, limits: ConnectionLimits, **kw: Any) -> None:
        # lingering_time: how long an unread request body is drained after the response
        # (a body that timed out, a refused upload) before the connection closes.
        kw.setdefault("lingering_time", 1.0)
        super().__init__(app, keepalive_timeout=limits.keepalive_timeout, **kw)
        self.limits = limits
        self.registry = _Registry(limits.max_connections or default_max_connections())

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = _GuardedServer  # same state, our handler factory
        assert isinstance(server, _GuardedServer)
        server.registry = self.registry
        server.header_timeout = self.limits.header_timeout
        return server
