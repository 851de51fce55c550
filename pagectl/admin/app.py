"""The aiohttp application: factory, shared state, middlewares.

``create_app(settings, engine)`` builds the app; the engine is started and stopped by the
app's ``cleanup_ctx`` (start: spawn + handshake + tokenizer; stop: shutdown), so the same
factory serves the daemon (an ``EngineClient``) and tests (an in-process engine).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pagectl.admin import wire
from pagectl.admin.errors import APIError
from pagectl.admin.formatting import TokenText
from pagectl.admin.json_fields import parse_json
from pagectl.admin.metrics import Metrics
from pagectl.admin.validation import ModelFacts

log = logging.getLogger("pagectl.admin")

DEFAULT_AUTH_ALLOW = ("/health", "/metrics")
DEFAULT_MAX_BODY_SIZE = 8 * 1024 * 1024


@dataclass
class ServerSettings:
    """HTTP-side options of the daemon."""

    # Name the API reports and accepts (None: the engine's model name).
    served_model_name: str | None = None
    # Accepted API keys (empty: no authentication).
    api_keys: list[str] = field(default_factory=list)
    # Paths reachable without a key when keys are set.
    auth_allow: tuple[str, ...] = DEFAULT_AUTH_ALLOW
    # Most requests queued for the engine (submitted, no output yet); past it: 503.
    max_num_queued_requests: int | None = None
    # Largest request body in bytes; past it: 413.
    max_body_size: int = DEFAULT_MAX_BODY_SIZE
    # Seconds a client is told to wait after a 503 for overload.
    retry_after_s: int = 1
    # A local tokenizer directory to start loading before the engine's handshake names it.
    tokenizer_hint: str | None = None


@dataclass
class ServerState:
    """Everything the handlers share. Owned by the event loop thread."""

    settings: ServerSettings
    # EngineClient or a test double with the same methods.
    engine: Any
    metrics: Metrics
    ready: wire.EngineReady | None = None
    facts: ModelFacts | None = None
    token_text: TokenText | None = None
    # Set on SIGTERM: new requests get 503, /health 503.
    draining: bool = False
    # HTTP generation requests being served (drain waits for them).
    num_active: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    start_time: float = field(default_factory=time.time)

    # Set once the engine has started (before the server listens); handlers use these.
    @property
    def model(self) -> ModelFacts:
        assert self.facts is not None, "the engine has not started"
        return self.facts

    @property
    def engine_ready(self) -> wire.EngineReady:
        assert self.ready is not None, "the engine has not started"
        return self.ready

    @property
    def tokens(self) -> TokenText:
        assert self.token_text is not None, "the engine has not started"
        return self.token_text

    def check_admission(self) -> None:
        """503 (with Retry-After when overloaded) unless a new request may go in."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.engine.dead is not None:
            raise APIError(
                503, f"the engine is not running: {self.engine.dead}", code="engine_dead"
            )
        limit = self.settings.max_num_queued_requests
        if limit is not None and self.engine.num_unstarted >= limit:
            raise APIError(
                503,
                f"the server is overloaded: {limit} requests are already queued; retry later",
                code="overloaded",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )

    def begin(self) -> None:
        self.num_active += 1
        self.idle.clear()

    def end(self) -> None:
        self.num_active -= 1
        if not self.num_active:
            self.idle.set()


STATE = web.AppKey("state", ServerState)


async def read_body(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object (400 wrong content type or bad JSON, 413 too big)."""
    if request.content_type != "application/json":
        raise APIError(
            400,
            f"Content-Type must be application/json, got {request.content_type or 'none'}",
            code="unsupported_content_type",
        )
    limit = request.app[STATE].settings.max_body_size
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(limit) from None
    return parse_json(raw)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves in OpenAI's shape."""
    try:
        return await handler(request)
    except APIError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 413:
            return _too_large(request.app[STATE].settings.max_body_size).response()
        headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")}
        return APIError(e.status, e.reason, headers=headers).response()
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return APIError(500, "internal server error").response()


@web.middleware
async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    """With API keys set, every path outside the allow-list needs ``Authorization: Bearer``."""
    settings = request.app[STATE].settings
    if settings.api_keys and request.path not in settings.auth_allow:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        given_b = given.strip().encode()
        # Compare against every key, whatever matches: timing says nothing about which.
        ok = False
        for key in settings.api_keys:
            ok |= hmac.compare_digest(given_b, key.encode())
        if scheme.lower() != "bearer" or not ok:
            raise APIError(
                401,
                "missing or invalid API key (send `Authorization: Bearer <key>`)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
    return await handler(request)


def _same_path(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _load_tokenizer(path: str) -> Any:
    from pagectl.engine.tokenizer import load_tokenizer

    try:
        return load_tokenizer(path)
    except Exception:  # a failed preload is retried from the handshake's path
        log.debug("tokenizer preload from %s failed", path, exc_info=True)
        return None


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    """Start the engine before the server listens; shut it down after the server closed."""
    state = app[STATE]
    loop = asyncio.get_running_loop()
    hint = state.settings.tokenizer_hint
    # The tokenizer loads (seconds: transformers import) while the engine builds.
    preload = loop.run_in_executor(None, _load_tokenizer, hint) if hint else None
    try:
        ready = await state.engine.start()
    except BaseException:
        if preload is not None:
            await asyncio.gather(preload, return_exceptions=True)
        raise
    tokenizer = None
    if ready.tokenizer_path:
        if preload is not None and hint and _same_path(hint, ready.tokenizer_path):
            tokenizer = await preload
        if tokenizer is None:
            from pagectl.engine.tokenizer import load_tokenizer

            tokenizer = await loop.run_in_executor(None, load_tokenizer, ready.tokenizer_path)
    state.ready = ready
    name = state.settings.served_model_name or ready.model_name
    state.facts = ModelFacts(
        name, ready.vocab_size, ready.max_model_len, tokenizer, dict(ready.sampling_defaults)
    )
    state.token_text = TokenText(tokenizer)
    info = ready.model_info
    static = {
        k: ready.config[k]
        for k in (
            "block_size",
            "num_kv_blocks",
            "max_model_len",
            "policy",
            "max_num_seqs_limit",
            "max_num_batched_tokens_limit",
        )
        if k in ready.config
    }
    static.update(
        dtype=info.dtype,
        device=info.device,
        tp_size=info.tp_size,
        kv_bytes_per_block=info.kv_bytes_per_block,
    )
    state.metrics.set_cache_config(static)
    try:
        yield
    finally:
        await state.engine.shutdown()


def create_app(settings: ServerSettings, engine: Any) -> web.Application:
    """The OpenAI-compatible application around ``engine`` (started by the app's cleanup_ctx)."""
    from pagectl.admin import routes

    app = web.Application(
        middlewares=[error_middleware, auth_middleware], client_max_size=settings.max_body_size
    )
    state = ServerState(settings, engine, Metrics(lambda: engine.stats))
    state.idle.set()
    app[STATE] = state
    app.cleanup_ctx.append(_engine_ctx)
    routes.add_routes(app)
    return app
