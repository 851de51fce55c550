"""Route table, and the small endpoints: models, health, version, tokenize, metrics."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from pagectl import __version__
from pagectl.server.anthropic_api import messages
from pagectl.server.body import read_body
from pagectl.server.errors import APIError, bad_request
from pagectl.server.json_fields import get_bool, is_int
from pagectl.server.openai_api import chat_completions, completions
from pagectl.server.state import STATE
from pagectl.server.validation import (
    ModelFacts,
    check_model,
    check_prompt_size,
    parse_messages,
    parse_prompts,
    render_chat,
    text_bytes,
)


def _model_card(state: Any, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": int(state.start_time),
        "owned_by": "pagectl",
        "root": state.engine_ready.model_path,
        "parent": None,
        "max_model_len": state.model.max_model_len,
    }


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(
        {"object": "list", "data": [_model_card(state, n) for n in state.model.names]}
    )


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}`` (the openai SDK's ``models.retrieve``)."""
    state = request.app[STATE]
    name = request.match_info["model_id"]
    if name not in state.model.names:
        raise APIError(
            404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
        )
    return web.json_response(_model_card(state, name))


async def health(request: web.Request) -> web.Response:
    """200 while serving; 503 while draining, when the engine is dead, or when it has sent
    nothing for --health-stall-timeout seconds (frozen, stopped, or in an endless step)."""
    state = request.app[STATE]
    if state.engine.dead is not None:
        raise APIError(503, f"the engine is not running: {state.engine.dead}", code="engine_dead")
    if state.draining:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    limit = state.settings.health_stall_timeout
    engines = getattr(state.engine, "engines", None)  # data parallel: DPEngineClient
    if engines is not None:
        return _dp_health(engines, limit)
    heard = getattr(state.engine, "last_heard", None)  # None: an in-process engine
    if limit > 0 and heard:
        silent = time.monotonic() - heard
        if silent > limit:
            raise APIError(
                503,
                f"the engine has not answered for {silent:.1f}s (limit {limit:g}s, "
                "--health-stall-timeout)",
                code="engine_stalled",
            )
    return web.Response(status=200)


def _dp_health(engines: list, limit: float) -> web.Response:
    """N data-parallel engines: 200 ``{"status": "ok" | "degraded", "engines": [...]}`` while
    one serves; 503 when none does (dead, or silent past --health-stall-timeout)."""
    now = time.monotonic()
    rows = []
    for i, e in enumerate(engines):
        if e.dead is not None:
            rows.append({"index": i, "state": "dead", "reason": e.dead})
        elif limit > 0 and e.last_heard and now - e.last_heard > limit:
            silent = f"no answer for {now - e.last_heard:.1f}s (limit {limit:g}s)"
            rows.append({"index": i, "state": "stalled", "reason": silent})
        else:
            rows.append({"index": i, "state": "ok"})
    serving = sum(r["state"] == "ok" for r in rows)
    if not serving:
        raise APIError(
            503,
            "no engine is serving: "
            + "; ".join(f"engine {r['index']} {r['state']}: {r['reason']}" for r in rows),
            code="engine_dead",
        )
    status = "ok" if serving == len(rows) else "degraded"
    return web.json_response({"status": status, "engines": rows})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def _tokenizer_request(request: web.Request) -> tuple[ModelFacts, Any, dict]:
    """The model, its tokenizer and the body of a /tokenize or /detokenize request (400 when
    the model has no tokenizer)."""
    facts = request.app[STATE].model
    body = await read_body(request)
    check_model(body, facts)
    if facts.tokenizer is None:
        raise bad_request("this model has no tokenizer")
    return facts, facts.tokenizer, body


def _tokenize(facts: ModelFacts, tokenizer: Any, body: dict) -> list[int]:
    if "messages" in body:
        return render_chat(parse_messages(body["messages"]), facts, body, context=False).token_ids
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("prompt must be a string", "prompt")
    add_special = get_bool(body, "add_special_tokens", True)
    check_prompt_size(text_bytes(prompt), facts, "prompt", context=False)
    return list(tokenizer.encode(prompt, add_special_tokens=add_special))


async def tokenize(request: web.Request) -> web.Response:
    """``{"prompt": str}`` or ``{"messages": [...]}`` -> token ids (tokenized off the loop)."""
    facts, tokenizer, body = await _tokenizer_request(request)
    ids = await request.app[STATE].offload.run(_tokenize, facts, tokenizer, body)
    return web.json_response(
        {"count": len(ids), "max_model_len": facts.max_model_len, "tokens": ids}
    )


async def detokenize(request: web.Request) -> web.Response:
    """``{"tokens": [int]}`` -> ``{"prompt": text}``."""
    facts, tokenizer, body = await _tokenizer_request(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        raise bad_request("tokens must be a list of token ids (integers)", "tokens")
    ids = parse_prompts(tokens, facts)[0].token_ids if tokens else []
    text = await request.app[STATE].offload.run(tokenizer.decode, ids)
    return web.json_response({"prompt": text})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/messages", messages)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id:.+}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/metrics", metrics)
