"""Checks every request body passes before any field is read: integer range and valid text.

A parsed JSON body can hold what no later stage can carry: integers of any size (msgpack,
the engine's wire format, holds 64 bits; ``float()`` overflows past ~1.8e308) and strings
with lone surrogates (JSON's ``"\\ud800"`` escape; such a string cannot be encoded as UTF-8,
so msgpack and the tokenizer fail on it). ``check_body`` refuses both with a 400 naming the
top-level field, for every field of every endpoint, so a new field is covered without code
of its own.

Choice for text: a string must be valid Unicode without lone surrogates; it is refused,
never passed on with ``surrogatepass`` (a surrogate is not text any tokenizer knows).
Integers must fit a signed 64-bit int, the widest the engine takes for any field.

Helpers for one field (``finite_float``, ``check_text``) are here too, for code that reads
values outside a JSON body.
"""

from __future__ import annotations

import re
from typing import Any

from pagectl.server.errors import bad_request

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

# A JSON text can only produce a lone surrogate through a \uD800-\uDFFF escape, and an
# integer out of int64 range only with 19 or more digits: bodies without either skip the walk.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
# Every ASCII digit to "0", every other byte to " ": a run of 19 digits (the shortest integer
# that can leave int64) is then one ``bytes.find``, tens of times faster on megabytes than
# the regex ``\d{19}``, which tries every position.
_DIGITS_TO_ZERO = bytes(0x30 if 0x30 <= i <= 0x39 else 0x20 for i in range(256))
_LONG_DIGIT_RUN = b"0" * 19


def _may_hold_long_int(raw: bytes) -> bool:
    return _LONG_DIGIT_RUN in raw.translate(_DIGITS_TO_ZERO)


def _path(parts: list[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def check_text(value: str, param: str | None = None, where: str | None = None) -> str:
    """``value`` if it is encodable as UTF-8 (no lone surrogate), else a 400."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad_request(
                f"{where or param or 'a string'} is not valid Unicode text: lone surrogate "
                f"\\u{ord(value[e.start]):04x} at position {e.start}",
                param,
            ) from None
    return value


def check_int64(value: int, param: str | None = None, where: str | None = None) -> int:
    if not INT64_MIN <= value <= INT64_MAX:
        digits = len(str(abs(value))) if abs(value) < 10**4000 else "over 4000"
        raise bad_request(
            f"{where or param or 'an integer'} is out of range: an integer must be >= -2**63 "
            f"and <= 2**63 - 1 (got one of {digits} digits)",
            param,
        )
    return value


def finite_float(value: Any, param: str) -> float:
    """A JSON number as a float; an integer beyond float range is a 400, not an OverflowError."""
    try:
        return float(value)
    except OverflowError:
        raise bad_request(f"{param} is out of range (beyond a 64-bit float)", param) from None


def check_body(body: dict[str, Any], raw: bytes | None = None) -> None:
    """400 for the first integer outside int64 or string with a lone surrogate, anywhere in
    ``body`` (keys too). ``raw``, the JSON text, lets bodies that cannot hold either skip the
    walk. Iterative: the depth is whatever the JSON parser accepted."""
    want_ints = raw is None or _may_hold_long_int(raw)
    want_text = raw is None or _SURROGATE_ESCAPE.search(raw) is not None
    if not (want_ints or want_text):
        return
    stack: list[tuple[Any, list[Any]]] = [(body, [])]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                if want_text:
                    check_text(k, _top(path, k), f"a key in {_path(path) or 'the body'}")
                stack.append((v, [*path, k]))
        elif isinstance(value, list):
            stack.extend((v, [*path, i]) for i, v in enumerate(value))
        elif isinstance(value, str) and want_text:
            check_text(value, _top(path), _path(path))
        elif isinstance(value, int) and not isinstance(value, bool) and want_ints:
            check_int64(value, _top(path), _path(path))


def _top(path: list[Any], key: Any = None) -> str | None:
    head = path[0] if path else key
    return head if isinstance(head, str) else None
