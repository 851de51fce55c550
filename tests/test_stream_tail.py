"""A client that leaves after the last token, before ``[DONE]``, is not a server error."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiohttp.client_exceptions import ClientConnectionResetError

from pagectl.server import openai_api


class ClosingResp:
    """A stream response whose transport closes once the tokens have been written."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    async def write(self, data: bytes) -> None:
        if b"[DONE]" in data or b"usage" in data:
            raise ClientConnectionResetError("Cannot write to closing transport")
        self.written.append(data)


def test_a_client_gone_before_done_ends_the_stream_quietly(monkeypatch):
    resp = ClosingResp()

    async def start_sse(request):
        return resp

    async def updates():
        yield "tok"

    fmt = SimpleNamespace(
        gen=SimpleNamespace(updates=updates),
        opening=lambda: [],
        update=lambda upd: {"text": upd},
        spec=SimpleNamespace(include_usage=True),
        usage_chunk=lambda: {"usage": 1},
    )
    monkeypatch.setattr(openai_api, "start_sse", start_sse)
    assert asyncio.run(openai_api._stream(None, fmt)) is resp  # no exception
    assert resp.written == [b'data: {"text":"tok"}\n\n']
