"""Token strings and logprobs in the OpenAI response formats, and SSE framing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from aiohttp import web

from pagectl.engine.outputs import TokenLogprobs

# OpenAI clients choke on -Infinity (not JSON); vLLM sends this floor instead.
LOGPROB_FLOOR = -9999.0

_json = msgspec.json.Encoder()


def clamp(lp: float) -> float:
    return lp if lp > LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN to the floor


class TokenText:
    """Text of single tokens (for logprobs), cached per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self._cache.get(tid)
        if s is None:
            if self.tokenizer is None:
                s = f"token_id:{tid}"
            else:
                s = self.tokenizer.decode([tid], skip_special_tokens=False)
            self._cache[tid] = s
        return s


def completion_logprobs(
    token_ids: Sequence[int],
    lps: Sequence[TokenLogprobs | None],
    token_text: TokenText,
    offset: int,
) -> dict[str, list]:
    """The completions ``logprobs`` object for these tokens; ``offset`` is the text offset of
    the first one. A None entry (the first prompt token) has no logprob."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for tid, lp in zip(token_ids, lps, strict=False):
        s = token_text(tid)
        tokens.append(s)
        text_offset.append(offset)
        offset += len(s)
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(clamp(lp.logprob))
        # Different ids can share a text (e.g. lone UTF-8 bytes); keep the likelier one.
        top: dict[str, float] = {}
        for t, v in lp.top:
            top.setdefault(token_text(t), clamp(v))
        top.setdefault(s, clamp(lp.logprob))
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def _entry(s: str, lp: float) -> dict[str, Any]:
    return {"token": s, "logprob": clamp(lp), "bytes": list(s.encode("utf-8"))}


def chat_logprobs(
    token_ids: list[int], lps: list[TokenLogprobs], token_text: TokenText, top_k: int
) -> dict[str, list]:
    """The chat ``logprobs`` object: ``{"content": [...]}`` with ``top_k`` alternatives each."""
    content = []
    for tid, lp in zip(token_ids, lps, strict=False):
        item = _entry(token_text(tid), lp.logprob)
        item["top_logprobs"] = [_entry(token_text(t), v) for t, v in lp.top[:top_k]]
        content.append(item)
    return {"content": content}


# -- SSE ----------------------------------------------------------------------------------


async def start_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await resp.prepare(request)
    return resp


async def send_event(resp: web.StreamResponse, obj: Any) -> None:
    """One SSE event: ``data: <json>\\n\\n``."""
    await resp.write(b"data: " + _json.encode(obj) + b"\n\n")


async def send_done(resp: web.StreamResponse) -> None:
    await resp.write(b"data: [DONE]\n\n")
