"""Bounded decoding of frames that come from outside the engine loop.

Every frame read from a socket (the control ROUTER, the engine's input PULL, the API
server's output PULL) goes through ``decode_frame``: the frame's size is checked first, then
it is decoded by a typed msgspec decoder, and every way that can fail -- a malformed frame,
a value of the wrong type, nesting deeper than the interpreter's recursion limit
(``RecursionError``: ``b"\\x91" * 2000 + b"\\xc0"`` is 2 KB) -- becomes one ``FrameError``.
Callers catch ``FrameError`` only, and never see anything else from a decode.

The sockets carry the same bounds as ``zmq.MAXMSGSIZE`` (see ``limit_socket``), so a peer
that sends more is disconnected by libzmq before the frame is ever held in memory; the
check here covers sockets made without it.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import zmq

T = TypeVar("T")

# An admin command is a few hundred bytes; a control frame past this is refused.
MAX_CONTROL_FRAME_BYTES = 1 << 20
# API server -> engine: a SubmitRequest holds one tokenized prompt (at most max_model_len
# ids, ~5 bytes each) and its sampling parameters; the HTTP body limit keeps it far below.
MAX_INPUT_FRAME_BYTES = 64 << 20
# engine -> API server: written only by our own engine; bounded all the same.
MAX_OUTPUT_FRAME_BYTES = 1 << 30


class FrameError(ValueError):
    """A frame that cannot be decoded (too big, malformed, wrong types, too deep)."""


def decode_frame(decoder: msgspec.msgpack.Decoder, frame: bytes, limit: int) -> Any:
    """``decoder.decode(frame)``, or ``FrameError`` whatever goes wrong."""
    if len(frame) > limit:
        raise FrameError(f"frame of {len(frame)} bytes is larger than the {limit}-byte limit")
    try:
        return decoder.decode(frame)
    except RecursionError:
        raise FrameError("frame is nested too deeply") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise FrameError(str(e)) from None
    except (ValueError, TypeError, OverflowError, UnicodeError, MemoryError) as e:
        raise FrameError(f"{type(e).__name__}: {e}") from None


# -- reading one field of a frame that did not decode ------------------------------------
#
# A frame can be malformed anywhere after its id (a value nested 2,000 deep, a wrong type),
# and msgspec would recurse into it even to skip it. ``peek_field`` reads the top-level map
# header by header without recursion, with a bounded number of steps, so the id of a bad
# request is found whenever it comes before the damage or beside it.

# Most msgpack headers looked at to find one field; past it the field counts as unreadable.
_MAX_PEEK_STEPS = 4096
_MISSING = object()


def _header(buf: bytes, i: int) -> tuple[int, int, int, Any]:
    """The msgpack item at ``i``: (position after its header and payload, number of child
    items that follow it, kind, scalar value or None). ``kind``: 0 other scalar, 1 str,
    2 int, 3 array, 4 map. Raises IndexError / ValueError on malformed input."""
    b = buf[i]
    if b <= 0x7F:
        return i + 1, 0, 2, b
    if b >= 0xE0:
        return i + 1, 0, 2, b - 0x100
    if 0x80 <= b <= 0x8F:
        return i + 1, 2 * (b & 0x0F), 4, None
    if 0x90 <= b <= 0x9F:
        return i + 1, b & 0x0F, 3, None
    if 0xA0 <= b <= 0xBF:
        n = b & 0x1F
        return i + 1 + n, 0, 1, buf[i + 1 : i + 1 + n]
    if b in (0xC0, 0xC2, 0xC3):
        return i + 1, 0, 0, None
    sized = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}  # bin8-32, str8-32
    if b in sized:
        w = sized[b]
        n = int.from_bytes(buf[i + 1 : i + 1 + w], "big")
        start = i + 1 + w
        if start + n > len(buf):
            raise ValueError("truncated")
        return start + n, 0, 1 if b >= 0xD9 else 0, buf[start : start + n]
    ints = {0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False)}
    ints.update({0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True)})
    if b in ints:
        w, signed = ints[b]
        if i + 1 + w > len(buf):
            raise ValueError("truncated")
        return i + 1 + w, 0, 2, int.from_bytes(buf[i + 1 : i + 1 + w], "big", signed=signed)
    if b in (0xCA, 0xCB):
        return i + (5 if b == 0xCA else 9), 0, 0, None
    if b in (0xDC, 0xDD, 0xDE, 0xDF):  # array16/32, map16/32
        w = 2 if b in (0xDC, 0xDE) else 4
        n = int.from_bytes(buf[i + 1 : i + 1 + w], "big")
        return i + 1 + w, n * (2 if b >= 0xDE else 1), 4 if b >= 0xDE else 3, None
    fixext = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
    if b in fixext:
        return i + 2 + fixext[b], 0, 0, None
    if b in (0xC7, 0xC8, 0xC9):  # ext8-32
        w = {0xC7: 1, 0xC8: 2, 0xC9: 4}[b]
        n = int.from_bytes(buf[i + 1 : i + 1 + w], "big")
        return i + 2 + w + n, 0, 0, None
    raise ValueError(f"invalid msgpack byte {b:#x}")


def peek_field(frame: bytes, path: tuple[str, ...]) -> Any:
    """The int or str at ``path`` (keys of nested maps) in a msgpack map, or None when it
    cannot be read within ``_MAX_PEEK_STEPS`` headers. Never recurses."""
    try:
        return _peek(frame, 0, path, [_MAX_PEEK_STEPS])
    except (IndexError, ValueError):
        return None


def _peek(buf: bytes, i: int, path: tuple[str, ...], budget: list[int]) -> Any:
    i, children, kind, _ = _header(buf, i)
    if kind != 4:
        return None
    for _ in range(children // 2):
        i, _, kkind, key = _header(buf, i)
        if kkind == 1 and bytes(key) == path[0].encode():
            if len(path) > 1:
                return _peek(buf, i, path[1:], budget)
            _, _, vkind, value = _header(buf, i)
            if vkind == 1:
                return bytes(value).decode("utf-8", "strict")
            return value if vkind == 2 else None
        i = _skip(buf, i, budget)
    return None


def _skip(buf: bytes, i: int, budget: list[int]) -> int:
    """Position after the item at ``i`` (iterative: a count of items still to skip)."""
    pending = 1
    while pending:
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError("too many items")
        i, children, _, _ = _header(buf, i)
        if i > len(buf):
            raise ValueError("truncated")
        pending += children - 1
    return i


def control_request_id(frame: bytes) -> int:
    """The id of a malformed control request when it can be read, else 0."""
    if len(frame) > MAX_CONTROL_FRAME_BYTES:
        return 0
    rid = peek_field(frame, ("id",))
    return rid if isinstance(rid, int) and 0 <= rid < 2**64 else 0


def submit_request_id(frame: bytes) -> str | None:
    """The request id of a malformed ``SubmitRequest`` when it can be read, else None."""
    if len(frame) > MAX_INPUT_FRAME_BYTES or peek_field(frame, ("t",)) != "add":
        return None
    rid = peek_field(frame, ("request", "request_id"))
    return rid if isinstance(rid, str) else None


def limit_socket(sock: zmq.Socket, limit: int) -> zmq.Socket:
    """Make libzmq drop (and disconnect) a peer whose frame is larger than ``limit``."""
    sock.setsockopt(zmq.MAXMSGSIZE, limit)
    return sock
