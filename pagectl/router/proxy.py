"""The router's HTTP app: OpenAI endpoints (and Anthropic's ``/v1/messages``) proxied to the backend the policy picks.

Per request: read the JSON body, find its token ids (a token-id prompt as is; text through a
live backend's ``/tokenize``, which applies the chat template the same way), hash its full
blocks as the engines do (``engine/kv/hashing.py``, the request's ``cache_salt`` included),
choose a backend, forward.

Invariants:
- A request is retried on another backend only while no backend has accepted it: a failed
  connection or a 503 before any byte of the response (the backend refused it). Once a
  backend answered, its response is the answer.
- Streams pass through chunk by chunk as they arrive. A backend lost mid-stream ends the
  client's stream with an SSE ``error`` event (OpenAI's error shape) and ``data: [DONE]``;
  on ``/v1/messages``, with Anthropic's ``event: error`` (its shape, no ``[DONE]``). The
  router's own errors there are in Anthropic's shape too.
- ``inflight`` of a backend counts the requests forwarded to it and not finished, exactly.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import zmq.asyncio
from aiohttp import web
from prometheus_client import generate_latest

from pagectl.control.fleet import BACKENDS_PATH
from pagectl.engine.kv.hashing import hash_request_blocks
from pagectl.router.backends import Backend, poll_forever
from pagectl.router.metrics import RouterMetrics
from pagectl.routing.policy import RoutingPolicy
from pagectl.server.anthropic_api import to_chat_body
from pagectl.server.errors import APIError

log = logging.getLogger("pagectl.router")

# Leading blocks hashed per request: affinity is decided by the start of the prompt.
MAX_HASHED_BLOCKS = 64
PROXIED = ("/v1/completions", "/v1/chat/completions", "/v1/messages")
# The path whose errors leave in Anthropic's shape rather than OpenAI's.
ANTHROPIC_PATH = "/v1/messages"
# Request headers passed on to the backend (the rest are hop-by-hop or the router's own).
FORWARD_HEADERS = (
    "Authorization",
    "x-api-key",
    "anthropic-version",
    "Content-Type",
    "Accept",
    "X-Request-Id",
)
# The router's own error types, in Anthropic's names (``server/anthropic_api.py``).
_ANTHROPIC_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "service_unavailable": "overloaded_error",
    "server_error": "api_error",
}


def _error(status: int, message: str, kind: str = "server_error", path: str = "") -> web.Response:
    """The router's own error, in the shape of the endpoint asked (OpenAI's or Anthropic's)."""
    if path == ANTHROPIC_PATH:
        err = {"type": _ANTHROPIC_TYPES.get(kind, "api_error"), "message": message}
        return web.json_response({"type": "error", "error": err}, status=status)
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


def _timed_out(e: BaseException) -> bool:
    """The request's own time limit ran out (not a failed or timed-out connection)."""
    return isinstance(e, asyncio.TimeoutError) and not isinstance(e, aiohttp.ClientConnectionError)


def _stream_error(backend: str, path: str = "", what: str = "") -> bytes:
    text = f"backend {backend} {what or 'was lost mid-stream'}"
    if path == ANTHROPIC_PATH:
        msg = {"type": "api_error", "message": text}
        data = json.dumps({"type": "error", "error": msg})
        return f"\n\nevent: error\ndata: {data}\n\n".encode()
    err = {
        "error": {
            "message": text,
            "type": "server_error",
            "param": None,
            "code": 502,
        }
    }
    # The blank lines end whatever partial event the backend left.
    return f"\n\ndata: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()


async def _write_quietly(out: web.StreamResponse, data: bytes | None) -> bool:
    """Write ``data`` (None: the end of the body) to the client; False if it has left."""
    try:
        if data is None:
            await out.write_eof()
        else:
            await out.write(data)
    except (ConnectionError, aiohttp.ClientConnectionResetError):
        return False
    return True


class Router:
    def __init__(
        self,
        backends: list[Backend],
        policy: RoutingPolicy,
        *,
        health_interval: float = 1.0,
        health_timeout: float | None = None,
        connect_timeout: float = 5.0,
        request_timeout: float | None = None,
    ) -> None:
        self.backends = backends
        self.policy = policy
        self.health_interval = health_interval
        # A health check's limit (None: the interval, at least 1 s).
        self.health_timeout = health_timeout or max(health_interval, 1.0)
        self.connect_timeout = connect_timeout
        # A whole proxied request's limit, streams included (None: none).
        self.request_timeout = request_timeout
        self.metrics = RouterMetrics()
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._zmq = zmq.asyncio.Context()

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(
                total=self.request_timeout, sock_connect=self.connect_timeout
            ),
            auto_decompress=False,
        )
        first = max(2.0, self.health_timeout)
        await asyncio.gather(*(b.poll(self.session, first) for b in self.backends))
        self._tasks.append(
            asyncio.create_task(
                poll_forever(self.backends, self.session, self.health_interval, self.health_timeout)
            )
        )
        for b in self.backends:
            self._tasks.append(asyncio.create_task(b.follow_events(self._zmq, self.policy)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
        self._zmq.term()

    # -- choosing ---------------------------------------------------------------------------

    async def _token_ids(self, path: str, body: dict) -> list[int] | None:
        if path == "/v1/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return prompt
            if not isinstance(prompt, str):
                return None  # a batch of prompts: routed by load
            tok_body: dict = {"prompt": prompt}
        else:
            if path == ANTHROPIC_PATH:
                try:  # the chat messages the daemon will template (system first)
                    body = to_chat_body(body)
                except APIError:
                    return None  # the backend refuses it with its own 400
            msgs = body.get("messages")
            if not isinstance(msgs, list):
                return None
            tok_body = {"messages": msgs}
        live = [b for b in self.backends if b.load.alive]
        if not live or self.session is None:
            return None
        b = min(live, key=lambda x: x.load.load)
        try:
            async with self.session.post(b.spec.url + "/tokenize", json=tok_body) as r:
                if r.status != 200:
                    return None
                tokens = (await r.json()).get("tokens")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None
        return tokens if isinstance(tokens, list) else None

    async def request_hashes(self, path: str, body: dict) -> list[bytes]:
        if self.policy.policy != "prefix":
            return []
        sizes = {b.block_size for b in self.backends if b.block_size}
        if len(sizes) != 1:
            return []  # unknown or mixed block sizes: no common hash chain
        tokens = await self._token_ids(path, body)
        if not tokens:
            return []
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        return hash_request_blocks(tokens, sizes.pop(), [], salt, MAX_HASHED_BLOCKS)

    def choose(self, hashes: list[bytes], exclude: set[str]) -> Backend | None:
        cands = [b for b in self.backends if b.name not in exclude]
        d = self.policy.choose([b.load for b in cands], hashes)
        if d is None:
            return None
        b = cands[d.index]
        self.metrics.decisions.labels(b.name, d.reason).inc()
        self.metrics.matched_blocks.labels(b.name).inc(d.matched_blocks)
        return b

    # -- handlers ---------------------------------------------------------------------------

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(
                400, "the request body is not valid JSON", "invalid_request_error", request.path
            )
        if not isinstance(body, dict):
            return _error(
                400, "the request body must be a JSON object", "invalid_request_error", request.path
            )
        hashes = await self.request_hashes(request.path, body)
        headers = {k: request.headers[k] for k in FORWARD_HEADERS if k in request.headers}
        tried: set[str] = set()
        assert self.session is not None
        while True:
            b = self.choose(hashes, tried)
            if b is None:
                self.metrics.requests.labels("none", "503").inc()
                return _error(503, "no backend is available", "service_unavailable", request.path)
            tried.add(b.name)
            b.load.inflight += 1
            try:
                resp = await self._forward(request, b, raw, headers)
            finally:
                b.load.inflight -= 1
            if resp is not None:
                self.metrics.requests.labels(b.name, str(resp.status)).inc()
                return resp
            self.metrics.retries.inc()

    async def _forward(
        self, request: web.Request, b: Backend, raw: bytes, headers: dict
    ) -> web.StreamResponse | None:
        """The backend's answer, or None when it did not accept the request (retry)."""
        assert self.session is not None
        try:
            upstream = await self.session.post(b.spec.url + request.path, data=raw, headers=headers)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            if _timed_out(e):  # it took the request and is slow: no retry, not marked down
                return self._timeout_error(b, request.path)
            log.warning("backend %s refused a request: %s", b.name, e)
            b.mark_down()
            return None
        async with upstream:
            if upstream.status == 503:
                await upstream.read()
                return None  # draining or full: another backend may take it
            ctype = upstream.headers.get("Content-Type", "application/json")
            if not ctype.startswith("text/event-stream"):
                try:
                    data = await upstream.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    if _timed_out(e):
                        return self._timeout_error(b, request.path)
                    b.mark_down()
                    return _error(
                        502, f"backend {b.name} was lost before it answered", path=request.path
                    )
                return web.Response(
                    body=data,
                    status=upstream.status,
                    content_type=None,
                    headers={"Content-Type": ctype},
                )
            out = web.StreamResponse(
                status=upstream.status, headers={"Content-Type": ctype, "Cache-Control": "no-cache"}
            )
            await out.prepare(request)
            chunks = upstream.content.iter_any().__aiter__()
            while True:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    timed_out = _timed_out(e)
                    if not timed_out:
                        b.mark_down()
                    self.metrics.stream_errors.labels(b.name).inc()
                    what = "did not finish within --request-timeout" if timed_out else ""
                    await _write_quietly(out, _stream_error(b.name, request.path, what))
                    break
                if not await _write_quietly(out, chunk):
                    return out  # the client left: closing the upstream aborts the request
            await _write_quietly(out, None)
            return out

    def _timeout_error(self, b: Backend, path: str) -> web.Response:
        log.warning("backend %s: a request ran past --request-timeout", b.name)
        return _error(
            504,
            f"backend {b.name} did not answer within the request timeout "
            f"({self.request_timeout:g} s)",
            "timeout",
            path,
        )

    async def list_backends(self, request: web.Request) -> web.Response:
        """``GET /router/backends``: the policy and each backend as the router sees it (what
        ``pagectl top --url ROUTER`` attaches to)."""
        body = {
            "routing": self.policy.policy,
            "max_skew": self.policy.max_skew,
            "backends": [b.describe() for b in self.backends],
        }
        return web.json_response(body)

    async def models(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        for b in self.backends:
            if not b.load.alive:
                continue
            try:
                async with self.session.get(b.spec.url + "/v1/models") as r:
                    return web.Response(
                        body=await r.read(), status=r.status, content_type="application/json"
                    )
            except (aiohttp.ClientError, asyncio.TimeoutError):
                b.mark_down()
        return _error(503, "no backend is available", "service_unavailable")

    async def health(self, request: web.Request) -> web.Response:
        alive = sum(b.load.alive for b in self.backends)
        body = {
            "status": "ok" if alive == len(self.backends) else ("degraded" if alive else "down"),
            "backends": {b.name: b.load.alive for b in self.backends},
        }
        return web.json_response(body, status=200 if alive else 503)

    async def render_metrics(self, request: web.Request) -> web.Response:
        m = self.metrics
        for b in self.backends:
            m.up.labels(b.name).set(1 if b.load.alive else 0)
            m.inflight.labels(b.name).set(b.load.inflight)
            m.event_batches.labels(b.name).set(b.num_event_batches)
            m.event_gaps.labels(b.name).set(b.num_event_gaps)
        return web.Response(
            body=generate_latest(m.registry), headers={"Content-Type": "text/plain; version=0.0.4"}
        )


ROUTER = web.AppKey("router", Router)


def create_router_app(router: Router) -> web.Application:
    app = web.Application(client_max_size=8 * 1024 * 1024)
    app[ROUTER] = router
    for path in PROXIED:
        app.router.add_post(path, router.proxy)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.render_metrics)
    app.router.add_get(BACKENDS_PATH, router.list_backends)

    async def on_startup(app: web.Application) -> None:
        await router.start()

    async def on_cleanup(app: web.Application) -> None:
        await router.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
