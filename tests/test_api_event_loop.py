"""Nothing slow runs on the API server's event loop.

A 7.5 MiB prompt once froze every other stream and /health for 32 s while it was tokenized
on the loop. Now text past --max-prompt-bytes is refused before any work, and tokenization
runs in a bounded worker thread: while a large /tokenize is being worked on, streams keep
their inter-token gaps under 1 s and /health answers.
"""

from __future__ import annotations

import asyncio
import json
import time

from test_api_errors import assert_openai_error

from pagectl.server.state import ServerSettings

BIG = 15 * 512 * 1024  # 7.5 MiB


async def _stream_gaps(client, stop: asyncio.Event) -> tuple[list[float], int]:
    """Streams one request after another until ``stop``; every gap between two events."""
    gaps: list[float] = []
    streams = 0
    while not stop.is_set():
        resp = await client.post(
            "/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 32, "stream": True, "ignore_eos": True},
        )
        assert resp.status == 200
        last = time.monotonic()
        async for _line in resp.content:
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        streams += 1
        await asyncio.sleep(0.01)
    return gaps, streams


async def _health_latencies(client, stop: asyncio.Event) -> list[float]:
    out = []
    while not stop.is_set():
        t0 = time.monotonic()
        resp = await client.get("/health")
        assert resp.status == 200
        out.append(time.monotonic() - t0)
        await asyncio.sleep(0.05)
    return out


async def _while_streaming(client, work):
    """Run ``work`` while streams and /health go on; the worst stream gap and /health time
    must stay under 1 s. On a loaded machine the bound is 3x what the same streams showed
    just before, when that is more (a frozen loop stalls for seconds, not a few 100 ms)."""
    stop = asyncio.Event()
    before, _ = await _stream_gaps_for(client, 0.5)
    limit = max(1.0, 3 * max(before))
    streams = asyncio.create_task(_stream_gaps(client, stop))
    health = asyncio.create_task(_health_latencies(client, stop))
    await asyncio.sleep(0.1)
    try:
        result = await work()
    finally:
        stop.set()
    (gaps, n), lat = await streams, await health
    assert n >= 1 and gaps and lat
    assert max(gaps) < limit, f"a stream stalled {max(gaps):.2f}s (limit {limit:.2f}s)"
    assert max(lat) < limit, f"/health took {max(lat):.2f}s (limit {limit:.2f}s)"
    return result


async def _stream_gaps_for(client, seconds: float) -> tuple[list[float], int]:
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(seconds, stop.set)
    return await _stream_gaps(client, stop)


async def test_a_7_5_mib_prompt_gets_400_while_streams_and_health_go_on(make_client):
    client, engine = await make_client()
    text = "x" * BIG

    async def send_big():
        out = []
        for path, body in (
            ("/v1/completions", {"prompt": text, "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
            ("/tokenize", {"prompt": text}),
        ):
            data = json.dumps(body).encode()  # encoded here, not by the client on the loop
            resp = await client.post(path, data=data, headers={"Content-Type": "application/json"})
            out.append((resp.status, await resp.json()))
        return out

    for status, err in await _while_streaming(client, send_big):
        assert status == 400
        assert "--max-prompt-bytes" in assert_openai_error(err)["message"]
    assert engine.num_unstarted == 0


async def test_tokenization_runs_off_the_event_loop(make_client):
    # Under the byte limit but slow to tokenize (seconds with the tiny tokenizer): on the
    # loop it would stall the streams; in the worker thread they go on.
    client, _ = await make_client(ServerSettings(max_prompt_bytes=1 << 20))
    text = "def f(x): return x + 1\n" * 20_000  # 460 KB

    async def tokenize():
        resp = await client.post("/tokenize", json={"prompt": text})
        return resp.status, await resp.json()

    t0 = time.monotonic()
    status, body = await _while_streaming(client, tokenize)
    assert status == 200 and body["count"] > 100_000, body
    assert time.monotonic() - t0 > 0.3  # the work was long enough to matter


async def test_a_prompt_that_cannot_fit_the_context_is_refused_before_tokenization(make_client):
    client, _ = await make_client()
    resp = await client.post("/v1/completions", json={"prompt": "y" * 300_000, "max_tokens": 2})
    assert resp.status == 400
    assert "maximum context length" in assert_openai_error(await resp.json(), "prompt")["message"]
