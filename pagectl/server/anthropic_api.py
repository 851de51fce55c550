"""``POST /v1/messages``: Anthropic's Messages API over the same engine.

The request is translated into a chat request (system, messages with text / tool_use /
tool_result blocks, tools, tool_choice, sampling fields) and validated by the same code as
``/v1/chat/completions``; the answer is Anthropic's message object, or its SSE sequence
(``message_start``, per block ``content_block_start`` / ``_delta`` / ``_stop``,
``message_delta`` with the stop reason and usage, ``message_stop``). Errors leave in
Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from typing import Any

import msgspec
from aiohttp import web

from pagectl.engine_process.client import EngineError
from pagectl.server.admission import admitted
from pagectl.server.body import read_body
from pagectl.server.chat_output import ChatOutput
from pagectl.server.errors import APIError, bad_request
from pagectl.server.formatting import start_sse
from pagectl.server.openai_api import _api_error, _checked
from pagectl.server.serving import Generation
from pagectl.server.state import STATE
from pagectl.server.validation import parse_chat

_json = msgspec.json.Encoder()

# Anthropic's documented request fields that pagectl does not implement (400 when set).
_REFUSED = ("thinking", "container", "mcp_servers", "context_management", "service_tier")
_KNOWN = frozenset(
    [
        "model",
        "messages",
        "system",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "stream",
        "tools",
        "tool_choice",
        "metadata",
    ]
)
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(e: APIError) -> web.Response:
    body = {
        "type": "error",
        "error": {"type": _ERROR_TYPES.get(e.status, "api_error"), "message": e.message},
    }
    return web.json_response(body, status=e.status, headers=e.headers)


# -- request ------------------------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for b in content:
            if not isinstance(b, dict) or b.get("type") != "text":
                raise bad_request(f"{where}: only text blocks are supported here", "messages")
            parts.append(str(b.get("text", "")))
        return "".join(parts)
    raise bad_request(f"{where} must be a string or a list of blocks", "messages")


def _messages(body: dict) -> list[dict]:
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_of(system, "system")})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be user or assistant", "messages")
        role = m["role"]
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or a list of blocks", "messages")
        texts: list[str] = []
        calls: list[dict] = []
        results: list[dict] = []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                texts.append(str(b.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                calls.append(
                    {
                        "id": b.get("id"),
                        "type": "function",
                        "function": {
                            "name": b.get("name"),
                            "arguments": json.dumps(b.get("input", {})),
                        },
                    }
                )
            elif kind == "tool_result" and role == "user":
                res = b.get("content", "")
                text = _text_of(res, f"{where}.content[{j}].content") if res else ""
                results.append(
                    {"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": text}
                )
            else:
                raise bad_request(
                    f"{where}.content[{j}]: `{kind}` blocks are not supported by pagectl here",
                    "messages",
                )
        out.extend(results)
        if texts or calls or not results:
            msg: dict[str, Any] = {"role": role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _tool_choice(tc: Any) -> Any:
    if tc is None:
        return None
    if not isinstance(tc, dict):
        raise bad_request("tool_choice must be an object", "tool_choice")
    kind = tc.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        return {"type": "function", "function": {"name": tc.get("name")}}
    raise bad_request("tool_choice.type must be auto, any, tool or none", "tool_choice")


def to_chat_body(body: dict) -> dict:
    """The equivalent ``/v1/chat/completions`` body (raises a 400 ``APIError``)."""
    for name in _REFUSED:
        if body.get(name) is not None:
            raise bad_request(f"`{name}` is not supported by pagectl", name)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise bad_request("max_tokens is required", "max_tokens")
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": _messages(body),
        "max_tokens": max_tokens,
    }
    for name in ("temperature", "top_p", "top_k", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools must be a list", "tools")
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.get("name"),
                    "description": t.get("description"),
                    "parameters": t.get("input_schema"),
                },
            }
            if isinstance(t, dict)
            else t
            for t in tools
        ]
    tc = body.get("tool_choice")
    if tc is not None:
        chat["tool_choice"] = _tool_choice(tc)
        if isinstance(tc, dict) and tc.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    meta = body.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise bad_request("metadata must be an object", "metadata")
    return chat


# -- response -----------------------------------------------------------------------------


def _stop(finish_reason: str | None, stop_reason: Any) -> tuple[str, str | None]:
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(gen: Generation, output_tokens: int) -> dict[str, int]:
    u = gen.usage()
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": u["prompt_tokens"] - cached,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _blocks(msg: dict) -> list[dict]:
    blocks: list[dict] = []
    if msg.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        blocks.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls", []):
        fn = call["function"]
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            args = {}
        blocks.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": args})
    return blocks


async def _event(resp: web.StreamResponse, name: str, data: dict) -> None:
    await resp.write(f"event: {name}\ndata: ".encode() + _json.encode(data) + b"\n\n")


class _BlockWriter:
    """Opens, feeds and closes content blocks as deltas of different kinds arrive."""

    def __init__(self, resp: web.StreamResponse) -> None:
        self.resp = resp
        self.index = -1
        self.kind: str | None = None

    async def _open(self, kind: str, block: dict) -> None:
        await self.close()
        self.index += 1
        self.kind = kind
        await _event(
            self.resp,
            "content_block_start",
            {"type": "content_block_start", "index": self.index, "content_block": block},
        )

    async def close(self) -> None:
        if self.kind is not None:
            await _event(
                self.resp, "content_block_stop", {"type": "content_block_stop", "index": self.index}
            )
            self.kind = None

    async def _delta(self, delta: dict) -> None:
        await _event(
            self.resp,
            "content_block_delta",
            {"type": "content_block_delta", "index": self.index, "delta": delta},
        )

    async def feed(self, delta: dict) -> None:
        if delta.get("reasoning_content"):
            if self.kind != "thinking":
                await self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            await self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            if self.kind != "text":
                await self._open("text", {"type": "text", "text": ""})
            await self._delta({"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or []:
            if call.get("id"):
                block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"]}
                await self._open("tool_use", {**block, "input": {}})
            frag = call["function"].get("arguments")
            if frag:
                await self._delta({"type": "input_json_delta", "partial_json": frag})


async def _stream(request: web.Request, gen: Generation, out: ChatOutput, model: str):
    resp: web.StreamResponse | None = None
    stream = out.stream()
    writer: _BlockWriter | None = None
    num_tokens = 0
    try:
        async for upd in gen.updates():
            if resp is None:
                resp = await start_sse(request)
                writer = _BlockWriter(resp)
                await _event(
                    resp,
                    "message_start",
                    {
                        "type": "message_start",
                        "message": {
                            "id": gen.request_id,
                            "type": "message",
                            "role": "assistant",
                            "model": model,
                            "content": [],
                            "stop_reason": None,
                            "stop_sequence": None,
                            "usage": _usage(gen, 0),
                        },
                    },
                )
            assert writer is not None
            num_tokens += len(upd.token_ids)
            c = upd.choice
            deltas, finish = stream.push(upd.text, upd.finished, c.finish_reason)
            for d in deltas:
                await writer.feed(d)
            if upd.finished:
                await writer.close()
                reason, seq = _stop(finish, c.stop_reason)
                await _event(
                    resp,
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": seq},
                        "usage": _usage(gen, len(c.token_ids)),
                    },
                )
                await _event(resp, "message_stop", {"type": "message_stop"})
    except EngineError as e:
        if resp is None:
            raise
        err = _api_error(e)
        with contextlib.suppress(ConnectionResetError):
            await _event(
                resp,
                "error",
                {"type": "error", "error": {"type": "api_error", "message": err.message}},
            )
        return resp
    except ConnectionResetError:
        if resp is None:
            raise
        return resp
    assert resp is not None
    return resp


async def messages(request: web.Request) -> web.StreamResponse:
    try:
        return await _messages_handler(request)
    except APIError as e:
        return anthropic_error(e)


async def _messages_handler(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_body(request)
    chat_body = to_chat_body(body)
    spec = await _checked(await state.offload.run(parse_chat, chat_body, state.model))
    gen = Generation(
        state.engine, state.model.tokenizer, spec, f"msg_{uuid.uuid4().hex}", state.metrics
    )
    chat = state.model.chat
    out = ChatOutput(spec.tools, chat.tool_call_parser, chat.reasoning_parser)
    model = state.model.served_model_name
    # The slot is released, and the engine freed, whatever happens (server/admission.py).
    with admitted(state, gen):
        try:
            gen.submit()
            if spec.stream:
                return await _stream(request, gen, out, model)
            await gen.run_to_end()
            (c,) = gen.choices
            msg, finish = out.message(c.detok.text, c.finish_reason)
            reason, seq = _stop(finish, c.stop_reason)
            return web.json_response(
                {
                    "id": gen.request_id,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": _blocks(msg),
                    "stop_reason": reason,
                    "stop_sequence": seq,
                    "usage": _usage(gen, len(c.token_ids)),
                }
            )
        except EngineError as e:
            raise _api_error(e) from None
