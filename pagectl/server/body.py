"""Reading a request's body: content type and size checked, then strict JSON whose integers
fit int64 and whose strings are valid text (``field_checks.check_body``)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from pagectl.server.errors import APIError
from pagectl.server.field_checks import check_body
from pagectl.server.json_fields import parse_json
from pagectl.server.state import STATE


async def read_body(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object (400 wrong content type or bad JSON, 413 too big)."""
    if request.content_type != "application/json":
        raise APIError(
            400,
            f"Content-Type must be application/json, got {request.content_type or 'none'}",
            code="unsupported_content_type",
        )
    settings = request.app[STATE].settings
    limit = settings.max_body_size
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    timeout = settings.connection_limits.body_timeout
    try:
        async with asyncio.timeout(timeout if timeout > 0 else None):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large(limit) from None
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout:g}s (--http-body-timeout)",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    if len(raw) > _INLINE_PARSE_BYTES:  # megabytes of JSON: parsed off the event loop
        return await request.app[STATE].offload.run(_parse, raw)
    return _parse(raw)


# Bodies up to this size are parsed on the event loop (well under a millisecond).
_INLINE_PARSE_BYTES = 64 * 1024


def _parse(raw: bytes) -> dict[str, Any]:
    body = parse_json(raw)
    check_body(body, raw)  # int64 range and valid text, for every field
    return body


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
