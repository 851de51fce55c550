"""``POST /v1/completions`` and ``POST /v1/chat/completions``: non-streaming and SSE.

Streaming sends one event per engine output (one token per sequence per step), so clients can
measure inter-token latency; each choice gets exactly one chunk with a finish_reason. The
response starts only with the first output, so a request the engine refuses still gets a
plain HTTP error. An error after the stream started is sent as an ``{"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import msgspec
from aiohttp import web

from pagectl.engine_process.client import (
    EngineDeadError,
    EngineError,
    RequestRejected,
    ServerStoppingError,
)
from pagectl.server.admission import admitted
from pagectl.server.body import read_body
from pagectl.server.chat_output import ChatOutput, ChoiceStream
from pagectl.server.errors import APIError
from pagectl.server.formatting import (
    chat_logprobs,
    clamp,
    completion_logprobs,
    send_done,
    send_event,
    start_sse,
)
from pagectl.server.serving import EngineRequestError, Generation, Update
from pagectl.server.state import STATE, ServerState
from pagectl.server.structured import check_grammar
from pagectl.server.validation import GenerationSpec, parse_chat, parse_completion

_json = msgspec.json.Encoder()


def _api_error(e: EngineError) -> APIError:
    if isinstance(e, (RequestRejected, EngineRequestError)):
        # Refused by the engine's own checks, or unable to run at all (e.g. it needs more KV
        # blocks than the pool has): a problem of this request, not of the server.
        return APIError(400, str(e))
    if isinstance(e, ServerStoppingError):
        return APIError(503, str(e), code="shutting_down")
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is not running: {e}", code="engine_dead")
    return APIError(500, str(e), code="engine_error")


def _json_response(obj: Any) -> web.Response:
    return web.Response(body=_json.encode(obj), content_type="application/json")


class _Format:
    """Response shapes of one endpoint."""

    prefix = ""
    obj = ""
    chunk_obj = ""

    def __init__(self, state: ServerState, spec: GenerationSpec, gen: Generation) -> None:
        self.state = state
        self.spec = spec
        self.gen = gen
        self.model = state.model.served_model_name

    def envelope(self, obj: str, choices: list) -> dict[str, Any]:
        return {
            "id": self.gen.request_id,
            "object": obj,
            "created": self.gen.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, choices: list) -> dict[str, Any]:
        out = self.envelope(self.chunk_obj, choices)
        if self.spec.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self) -> dict[str, Any]:
        out = self.envelope(self.chunk_obj, [])
        out["usage"] = self.gen.usage()
        return out

    def full(self) -> dict[str, Any]:
        out = self.envelope(self.obj, self.choices())
        out["usage"] = self.gen.usage()
        return out

    def opening(self) -> list[dict]:
        """Chunks sent once when the stream starts."""
        return []

    def choices(self) -> list[dict]:
        raise NotImplementedError

    def update(self, upd: Update) -> dict:
        raise NotImplementedError


class _CompletionFormat(_Format):
    prefix = "cmpl"
    obj = "text_completion"
    chunk_obj = "text_completion"

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        # Text offset reached by each choice's streamed text (for logprobs.text_offset).
        self.offsets = [0] * len(self.gen.choices)

    def _prompt_text(self, c) -> str:
        p = c.run.prompt
        if p.text is not None:
            return p.text
        tok = self.state.model.tokenizer
        return tok.decode(p.token_ids) if tok is not None else ""

    def choices(self) -> list[dict]:
        out = []
        tt = self.state.tokens
        for c in self.gen.choices:
            text = c.detok.text
            lp = None
            if self.spec.echo:
                prompt_text = self._prompt_text(c)
                text = prompt_text + text
            if self.spec.logprobs is not None:
                ids: list[int] = []
                lps: list = []
                if self.spec.echo:
                    p_ids = c.run.prompt.token_ids
                    p_lps = c.run.prompt_logprobs
                    ids = list(p_ids)
                    lps = [None] + [
                        p_lps[i - 1] if i - 1 < len(p_lps) else None for i in range(1, len(p_ids))
                    ]
                ids += c.token_ids
                lps += c.logprobs
                lp = completion_logprobs(ids, lps, tt, 0)
            choice = {
                "index": c.index,
                "text": text,
                "logprobs": lp,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if self.spec.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs(c)
            out.append(choice)
        return out

    def _prompt_logprobs(self, c) -> list[dict | None]:
        """vLLM's shape: None for the first prompt token, then per token
        {token id: {"logprob", "rank", "decoded_token"}} with the token itself and its top-k."""
        tt = self.state.tokens
        ids = c.run.prompt.token_ids
        lps = c.run.prompt_logprobs
        out: list[dict | None] = [None]
        for tid, lp in zip(ids[1:], lps, strict=False):
            entry = {
                str(t): {"logprob": clamp(v), "rank": r + 1, "decoded_token": tt(t)}
                for r, (t, v) in enumerate(lp.top)
            }
            entry.setdefault(
                str(tid), {"logprob": clamp(lp.logprob), "rank": lp.rank, "decoded_token": tt(tid)}
            )
            out.append(entry)
        return out

    def opening(self) -> list[dict]:
        if not self.spec.echo:
            return []
        chunks = []
        for c in self.gen.choices:
            text = self._prompt_text(c)
            self.offsets[c.index] = len(text)
            chunks.append(
                self.chunk(
                    [{"index": c.index, "text": text, "logprobs": None, "finish_reason": None}]
                )
            )
        return chunks

    def update(self, upd: Update) -> dict:
        c = upd.choice
        lp = None
        if self.spec.logprobs is not None and upd.logprobs:
            lp = completion_logprobs(
                upd.token_ids, upd.logprobs, self.state.tokens, self.offsets[c.index]
            )
            self.offsets[c.index] += sum(len(t) for t in lp["tokens"])
        choice = {
            "index": c.index,
            "text": upd.text,
            "logprobs": lp,
            "finish_reason": c.finish_reason if upd.finished else None,
        }
        if upd.finished:
            choice["stop_reason"] = c.stop_reason
        return self.chunk([choice])


class _ChatFormat(_Format):
    prefix = "chatcmpl"
    obj = "chat.completion"
    chunk_obj = "chat.completion.chunk"

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        chat = self.state.model.chat
        self.output = ChatOutput(self.spec.tools, chat.tool_call_parser, chat.reasoning_parser)
        self.streams: dict[int, ChoiceStream] = {}

    def _logprobs(self, ids: list[int], lps: list) -> dict | None:
        if self.spec.logprobs is None:
            return None
        return chat_logprobs(ids, lps, self.state.tokens, self.spec.logprobs)

    def choices(self) -> list[dict]:
        out = []
        for c in self.gen.choices:
            message, finish_reason = self.output.message(c.detok.text, c.finish_reason)
            out.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(c.token_ids, c.logprobs),
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return out

    def opening(self) -> list[dict]:
        return [
            self.chunk(
                [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for c in self.gen.choices
        ]

    def update(self, upd: Update) -> list[dict]:  # type: ignore[override]
        c = upd.choice
        stream = self.streams.get(c.index)
        if stream is None:
            stream = self.streams[c.index] = self.output.stream()
        deltas, finish_reason = stream.push(upd.text, upd.finished, c.finish_reason)
        lp = self._logprobs(upd.token_ids, upd.logprobs) if upd.logprobs else None
        chunks = []
        # Plain text ends with its finish_reason on the last content delta; tool calls end
        # with a chunk of their own, as OpenAI's do.
        merge_finish = upd.finished and self.output.mode == "none" and bool(deltas)
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            choice = {
                "index": c.index,
                "delta": delta,
                "logprobs": lp if last else None,
                "finish_reason": finish_reason if (last and merge_finish) else None,
            }
            if last and merge_finish:
                choice["stop_reason"] = c.stop_reason
            chunks.append(self.chunk([choice]))
        if (upd.finished and not merge_finish) or not chunks:
            choice = {
                "index": c.index,
                "delta": {},
                "logprobs": lp if not chunks else None,
                "finish_reason": finish_reason if upd.finished else None,
            }
            if upd.finished:
                choice["stop_reason"] = c.stop_reason
            if upd.finished or lp is not None:
                chunks.append(self.chunk([choice]))
        return chunks


async def _stream(request: web.Request, fmt: _Format) -> web.StreamResponse:
    gen = fmt.gen
    resp: web.StreamResponse | None = None
    try:
        async for upd in gen.updates():
            if resp is None:
                resp = await start_sse(request)
                for chunk in fmt.opening():
                    await send_event(resp, chunk)
            out = fmt.update(upd)
            for chunk in out if isinstance(out, list) else [out]:
                await send_event(resp, chunk)
    except EngineError as e:
        if resp is None:
            raise
        with contextlib.suppress(ConnectionResetError):
            await send_event(resp, _api_error(e).body())
            await send_done(resp)
        return resp
    except ConnectionResetError:
        # The client went away mid-stream; _generate's cleanup aborts the request.
        if resp is None:
            raise
        return resp
    if resp is None:
        resp = await start_sse(request)
    # The client may leave after the last token and before [DONE]: nothing to answer then.
    with contextlib.suppress(ConnectionResetError):
        if fmt.spec.include_usage:
            await send_event(resp, fmt.usage_chunk())
        await send_done(resp)
    return resp


async def _generate(
    request: web.Request, spec: GenerationSpec, fmt_cls: type[_Format]
) -> web.StreamResponse:
    state = request.app[STATE]
    gen = Generation(
        state.engine,
        state.model.tokenizer,
        spec,
        f"{fmt_cls.prefix}-{uuid.uuid4().hex}",
        state.metrics,
    )
    fmt = fmt_cls(state, spec, gen)
    # The slot is released, and the engine freed, whatever happens (also on disconnect).
    with admitted(state, gen):
        try:
            gen.submit()
            if spec.stream:
                return await _stream(request, fmt)
            await gen.run_to_end()
            return _json_response(fmt.full())
        except EngineError as e:
            raise _api_error(e) from None


async def _checked(spec: GenerationSpec) -> GenerationSpec:
    """A constrained request's grammar is built once here, off the event loop: a constraint
    the backend cannot use is a 400 before anything reaches the engine."""
    if spec.constraint is not None:
        await asyncio.to_thread(check_grammar, spec.constraint)
    return spec


async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_body(request)
    state = request.app[STATE]
    # Validation tokenizes: off the event loop (server/offload.py).
    spec = await _checked(await state.offload.run(parse_completion, body, state.model))
    return await _generate(request, spec, _CompletionFormat)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_body(request)
    state = request.app[STATE]
    # Validation renders the chat template (sandboxed, time- and size-limited) and
    # tokenizes: off the event loop (server/offload.py).
    spec = await _checked(await state.offload.run(parse_chat, body, state.model))
    return await _generate(request, spec, _ChatFormat)
