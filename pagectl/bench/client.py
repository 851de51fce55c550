"""A streaming benchmark client for OpenAI-compatible completion servers (aiohttp).

``run_clients`` keeps ``concurrency`` requests in flight (closed loop: a client sends its next
request when the previous one ended) until every payload has been sent, and records what
each stream looked like: when it was sent, when each token chunk arrived, when it ended.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

from pagectl.bench.stats import RequestTiming


def parse_sse_line(line: bytes | str) -> dict | str | None:
    """One SSE line: the decoded JSON of a ``data:`` line, "[DONE]", or None for anything else."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return "[DONE]"
    if not data:
        return None
    return json.loads(data)


def apply_chunk(timing: RequestTiming, chunk: dict, now: float) -> None:
    """Account one decoded stream chunk into ``timing``.

    A chunk with a choice counts as one token when it carries text, or when it is not the
    closing chunk (a token may decode to no text yet). ``usage`` (include_usage) gives the
    exact output token count when the server sends it.
    """
    err = chunk.get("error")
    if err:
        timing.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return
    choices = chunk.get("choices") or []
    if choices:
        c = choices[0]
        text = c.get("text")
        if text is None:
            text = (c.get("delta") or {}).get("content") or ""
        if text or c.get("finish_reason") is None:
            timing.chunk_times.append(now)
            timing.chunk_tokens.append(1)
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        timing.usage_output_tokens = int(usage["completion_tokens"])


async def stream_one(
    session, url: str, payload: dict, headers: dict | None = None
) -> RequestTiming:
    """POST one streaming completion and time it. Never raises for a failed request."""
    timing = RequestTiming(start=time.perf_counter())
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                body = await resp.text()
                timing.error = f"HTTP {resp.status}: {body[:200]}"
                return timing
            async for raw in resp.content:
                now = time.perf_counter()
                item = parse_sse_line(raw)
                if item is None:
                    continue
                if item == "[DONE]":
                    break
                assert isinstance(item, dict)
                apply_chunk(timing, item, now)
                if timing.error:
                    break
    except Exception as e:  # aiohttp.ClientError, OSError, timeouts, bad JSON: recorded
        timing.error = f"{type(e).__name__}: {e}"
    finally:
        timing.end = time.perf_counter()
    if timing.error is None and not timing.chunk_times:
        timing.error = "no token arrived"
    return timing


async def run_clients(
    url: str,
    payloads: Sequence[dict],
    concurrency: int,
    *,
    headers: dict | None = None,
    request_timeout_s: float = 600.0,
) -> tuple[list[RequestTiming], float]:
    """Send every payload with at most ``concurrency`` in flight. Returns (timings, seconds)."""
    import aiohttp

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    timings: list[RequestTiming | None] = [None] * len(payloads)
    next_index = iter(range(len(payloads)))
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    # A fresh loopback connection per request, for every engine alike: llama-server closes
    # a connection after a streamed answer, and a client reusing it failed the next request
    # ("Can not write request body").
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client() -> None:
            for i in next_index:  # shared iterator: each index is taken by one client
                timings[i] = await stream_one(session, url, payloads[i], headers)

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(min(concurrency, len(payloads)))))
        duration = time.perf_counter() - t0
    return [t for t in timings if t is not None], duration
