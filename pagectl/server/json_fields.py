"""Reading a request body: strict JSON, then typed fields that name themselves in errors.

``parse_json`` refuses what Python's JSON parser would let through (NaN, Infinity, numbers
that overflow to infinity); the ``get_*`` readers return a field's value or default, or raise
a 400 ``APIError`` whose ``param`` is the field. JSON ``null`` counts as absent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import msgspec

from pagectl.server.errors import bad_request

# Bodies from this size on are decoded by msgspec first: several times faster than ``json``
# on megabytes, and both hold the GIL while they run. msgspec is the stricter of the two
# (NaN, Infinity, overflowing numbers, a BOM, invalid UTF-8 all fail), so a body it decodes
# is one ``json`` would give the same objects for; a body it refuses is parsed again by
# ``json`` below, which says what is wrong exactly as for a small body.
FAST_PARSE_BYTES = 64 * 1024
_fast_decode = msgspec.json.Decoder().decode


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object. NaN, Infinity and overflowing numbers are refused."""
    if len(raw) >= FAST_PARSE_BYTES:
        try:
            obj = _fast_decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            pass  # the exact reason comes from the parse below
        else:
            if isinstance(obj, dict):
                return obj
    try:
        obj = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request(f"the body must be a JSON object, got {type(obj).__name__}")
    return obj


# -- field readers ------------------------------------------------------------------------


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _field(body: dict, name: str, default: Any, ok: Callable[[Any], bool], kind: str) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not ok(v):
        raise bad_request(f"{name} must be {kind}, got {json.dumps(v)}", name)
    return v


def get_int(body: dict, name: str, default: Any = None) -> Any:
    return _field(body, name, default, is_int, "an integer")


def get_number(body: dict, name: str, default: Any = None) -> Any:
    return _field(body, name, default, is_number, "a number")


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    return _field(body, name, default, lambda v: isinstance(v, bool), "true or false")


def get_str(body: dict, name: str, default: Any = None) -> Any:
    return _field(body, name, default, lambda v: isinstance(v, str), "a string")
