"""The aiohttp application: factory, middlewares, the engine's start and stop.

``create_app(settings, engine)`` builds the app; the engine is started and stopped by the
app's ``cleanup_ctx`` (start: spawn + handshake + tokenizer; stop: shutdown), so the same
factory serves the daemon (an ``EngineClient``) and tests (an in-process engine).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from pagectl.engine_process.client import EngineClientProtocol
from pagectl.server import routes
from pagectl.server.admission import register_admission_gauges
from pagectl.server.body import too_large
from pagectl.server.errors import APIError
from pagectl.server.formatting import TokenText
from pagectl.server.metrics import Metrics
from pagectl.server.state import STATE, ServerSettings, ServerState
from pagectl.server.validation import ModelFacts

log = logging.getLogger("pagectl.server")


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
            return too_large(request.app[STATE].settings.max_body_size).response()
        headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")}
        return APIError(e.status, e.reason, headers=headers).response()
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return APIError(500, "internal server error").response()


@web.middleware
async def cors_middleware(request: web.Request, handler) -> web.StreamResponse:
    """CORS for --allowed-origins: preflight answered here, the origin echoed on responses."""
    allowed = request.app[STATE].settings.allowed_origins
    origin = request.headers.get("Origin")
    if not allowed or origin is None or ("*" not in allowed and origin not in allowed):
        return await handler(request)
    cors = {
        "Access-Control-Allow-Origin": "*" if "*" in allowed else origin,
        "Vary": "Origin",
    }
    if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        cors.update(
            {
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": request.headers.get(
                    "Access-Control-Request-Headers", "Authorization, Content-Type"
                ),
                "Access-Control-Max-Age": "600",
            }
        )
        return web.Response(status=204, headers=cors)
    resp = await handler(request)
    if not resp.prepared:
        resp.headers.update(cors)
    return resp


@web.middleware
async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    """With API keys set, every path outside the allow-list needs ``Authorization: Bearer``."""
    settings = request.app[STATE].settings
    if settings.api_keys and request.path not in settings.auth_allow:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if "x-api-key" in request.headers and not given:
            # Anthropic's clients send the key in x-api-key.
            scheme, given = "bearer", request.headers["x-api-key"]
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


def max_chars_per_token(tokenizer: Any) -> int:
    """The longest vocabulary entry in characters (0: no tokenizer or no vocabulary)."""
    if tokenizer is None:
        return 0
    try:
        return max((len(t) for t in tokenizer.get_vocab()), default=0)
    except Exception:  # a tokenizer without get_vocab: no context pre-check
        return 0


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
        name,
        ready.vocab_size,
        ready.max_model_len,
        tokenizer,
        dict(ready.sampling_defaults),
        max_prompt_bytes=state.settings.max_prompt_bytes,
        max_chars_per_token=await loop.run_in_executor(None, max_chars_per_token, tokenizer),
        chat=state.settings.chat,
        aliases=tuple(a for a in state.settings.served_model_aliases if a != name),
    )
    state.token_text = TokenText(tokenizer)
    info = ready.model_info
    static: dict[str, Any] = {
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
        state.offload.shutdown()
        await state.engine.shutdown()


def create_app(settings: ServerSettings, engine: EngineClientProtocol) -> web.Application:
    """The OpenAI-compatible application around ``engine`` (started by the app's cleanup_ctx)."""
    app = web.Application(
        middlewares=[cors_middleware, error_middleware, auth_middleware],
        client_max_size=settings.max_body_size,
    )
    state = ServerState(settings, engine, Metrics(engine.engine_stats))
    state.idle.set()
    app[STATE] = state
    register_admission_gauges(state.metrics.registry, state)
    app.cleanup_ctx.append(_engine_ctx)
    routes.add_routes(app)
    return app
