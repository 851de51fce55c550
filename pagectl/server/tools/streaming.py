"""Streaming tool calls as they are generated: ``CallScanner`` reads a growing output and
yields OpenAI's tool-call deltas (a call's ``index``, ``id``, ``type`` and ``function.name``
once its name is complete, then ``function.arguments`` fragments as the arguments grow).

What it reads: JSON calls ``{"name": ..., "arguments" | "parameters": ...}``, alone or in a
top-level array (``[{...}, {...}]``), between text it skips: parser markers (``<tool_call>``,
``</tool_call>``, ``[TOOL_CALLS]``, ``<|python_tag|>``, given by the caller) and anything
else outside a JSON value. The argument fragments are the generated text of the arguments'
JSON value, exactly; joined they are that value's text (a JSON string as the arguments gives
its value, as a whole response does).

Invariants: every character is scanned once (``feed`` costs the new text only); a call's
opening delta precedes its fragments; nothing is sent for a call before its name is
complete; a call whose arguments did not appear by its closing brace gets ``{}``.

Held text: positions are absolute (characters since the first ``feed``), and of the scanned
text the scanner keeps only what it may still read: from just after the last ``:`` (a
number, true, false or null as the arguments is the text from there, whatever lies between)
and from the start of a string the call reads (a key, its name, string arguments). The
arguments are sent up to the scanned position at the end of each ``feed``, so their next
fragment starts in the text fed after it.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pagectl.server.tools.response import ToolCall, arguments_delta

_ARGUMENT_KEYS = ("arguments", "parameters")
_SHORT_CHUNK = 256  # a held chunk shorter than this takes in the next scanned text


@dataclass
class _Call:
    """A call object being read."""

    depth: int  # the scanner's depth inside this object
    key: str | None = None  # the member being read (None: its key comes next)
    value_read: bool = False  # the member's value was a string, already read
    name: str | None = None
    call: ToolCall | None = None  # set once the opening delta went out
    index: int = -1  # the call's index in the choice's tool_calls
    args_start: int = -1  # where the arguments' value starts (absolute position)
    args_sent: int = -1  # how far the arguments were sent (absolute position)
    args_done: bool = False
    pending: list[str] = field(default_factory=list)  # fragments before the name was known


class CallScanner:
    """Incremental tool-call deltas for one streamed choice.

    Args:
        markers: text to skip between calls (a marker cut at the end of the text so far
            waits for more).
    """

    def __init__(self, markers: tuple[str, ...] = ()) -> None:
        self.markers = markers
        self.text = ""  # the text from ``base`` on: the unscanned rest, then new text
        self.base = 0  # absolute position of ``text[0]`` (``pos`` between feeds)
        # Scanned text before ``base`` still needed, oldest first, ending at ``base``.
        self.held: deque[str] = deque()
        self.held_chars = 0  # their total length
        self.colon = -1  # absolute position of the last ":" before ``base``
        self.pos = 0  # next character to scan (absolute position)
        self.depth = 0  # JSON nesting depth (objects and arrays)
        self.in_string = False
        self.escape = False
        self.string_start = -1  # where the current string token starts (its quote)
        self.last_string: str | None = None  # the last complete string at any depth
        self.top_array = False  # the current top-level value is an array
        self.current: _Call | None = None
        self._calls: list[ToolCall] = []  # calls whose opening delta went out, in order
        # Fragments sent but not yet added to their call's ``arguments``, by call index.
        self._unsynced: dict[int, list[str]] = {}
        self.scalar_start = -1  # an arguments value that is not an object or array

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Tool-call delta entries (each one ``delta.tool_calls`` element) for new text."""
        self.text = t = self.text + text  # the unscanned rest is shorter than a marker
        out: list[dict[str, Any]] = []
        b = self.base
        n = len(t)
        i = self.pos - b  # ``i`` indexes ``t``; the methods take absolute positions
        while i < n:
            ch = t[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    self._string_end(b + i, out)
                i += 1
                continue
            if self.depth == 0:
                skip = self._marker_at(i)
                if skip is None:
                    break  # a marker may be starting: wait for more text
                if skip:
                    i += skip
                    continue
                if ch in "{[":
                    self.top_array = ch == "["
                    self._open(ch, b + i, out)
                i += 1
                continue
            if ch == '"':
                self.in_string = True
                self.string_start = b + i
            elif ch in "{[":
                self._open(ch, b + i, out)
            elif ch in "}]":
                self._close(b + i, out)
            elif ch == ",":
                self._comma(b + i, out)
            i += 1
        self.pos = b + i
        self._flush_args(out)
        if i:
            self._hold(t, i)
        return out

    @property
    def calls(self) -> list[ToolCall]:
        """The calls whose opening delta went out, in order, with the arguments sent."""
        for index, fragments in self._unsynced.items():
            self._calls[index].arguments += "".join(fragments)
        self._unsynced.clear()
        return self._calls

    @property
    def retained_chars(self) -> int:
        """How many characters of the text the scanner keeps."""
        return self.held_chars + len(self.text)

    # -- held text -------------------------------------------------------------------------

    def _hold(self, t: str, cut: int) -> None:
        """Move the scanned ``t[:cut]`` out of ``text``; let go of what is no longer needed."""
        scanned = t if cut == len(t) else t[:cut]
        start = self.base
        self.base = base = start + cut  # == pos
        self.text = t[cut:]
        k = scanned.rfind(":")
        if k >= 0:
            self.colon = start + k
        keep = self.colon + 1
        if self.in_string and self._reads_string():
            keep = min(keep, self.string_start)
        held = self.held
        if keep >= base:
            if held:
                held.clear()
                self.held_chars = 0
            return
        if held and len(held[-1]) < _SHORT_CHUNK:
            held[-1] += scanned  # (few long chunks, not one per feed: copies a short one)
        else:
            held.append(scanned)
        chars = self.held_chars + cut
        # Drop the chunks that end at or before ``keep``.
        while base - chars + len(held[0]) <= keep:
            chars -= len(held.popleft())
        self.held_chars = chars

    def _slice(self, start: int, end: int) -> str:
        """The text from ``start`` to ``end`` (absolute positions, still held)."""
        b = self.base
        if start >= b:
            return self.text[start - b : end - b]
        assert start >= b - self.held_chars, "text no longer held"
        parts = [self.text[: max(end - b, 0)]]
        lo = b
        for chunk in reversed(self.held):
            hi, lo = lo, lo - len(chunk)
            if lo < end:
                parts.append(
                    chunk[max(start - lo, 0) : end - lo] if start > lo or end < hi else chunk
                )
            if lo <= start:
                break
        return "".join(reversed(parts))

    def _colon_before(self, i: int) -> int:
        """Absolute position of the last ":" before ``i`` (-1: none)."""
        k = self.text.rfind(":", 0, i - self.base)
        return self.base + k if k >= 0 else self.colon

    def _reads_string(self) -> bool:
        """Whether the string being read is one the call reads: a key of the call, its name
        or its arguments (``_string_end`` reads no other string's text)."""
        cur = self.current
        if cur is None or cur.depth != self.depth:
            return False
        if cur.key is None:
            return True
        if cur.value_read:
            return False
        if cur.key == "name":
            return cur.name is None
        return cur.key in _ARGUMENT_KEYS and cur.args_start < 0

    # -- structure -------------------------------------------------------------------------

    def _marker_at(self, i: int) -> int | None:
        """Length of the marker at ``text[i]`` (0: none; None: the text ends inside one)."""
        t = self.text
        left = len(t) - i
        for m in self.markers:
            if t.startswith(m, i):
                return len(m)
            if left < len(m) and m.startswith(t[i:]):
                return None
        return 0

    def _open(self, ch: str, i: int, out: list) -> None:
        cur = self.current
        if (
            cur is not None
            and cur.depth == self.depth
            and cur.key in _ARGUMENT_KEYS
            and cur.args_start < 0
        ):
            cur.args_start = i
        self.depth += 1
        # A call object: a top-level object, or an object in a top-level array.
        if ch == "{" and (self.depth == 1 or (self.depth == 2 and self.top_array)):
            self.current = _Call(self.depth)

    def _close(self, i: int, out: list) -> None:
        cur = self.current
        if cur is not None:
            if cur.depth == self.depth:
                # The call object closes.
                self._end_scalar(i, out)
                if cur.args_start < 0 and cur.name is not None:
                    cur.pending.append("{}")
                    self._open_call(cur, out)
                cur.args_done = True
                self._flush_call(cur, out)
                self.current = None
            elif (
                cur.depth + 1 == self.depth
                and cur.key in _ARGUMENT_KEYS
                and cur.args_start >= 0
                and not cur.args_done
            ):
                # The arguments' object or array closes.
                self._take(cur, i + 1, out)
                cur.args_done = True
        self.depth -= 1

    def _comma(self, i: int, out: list) -> None:
        cur = self.current
        if cur is not None and cur.depth == self.depth:
            self._end_scalar(i, out)
            cur.key = None
            cur.value_read = False

    def _string_end(self, i: int, out: list) -> None:
        cur = self.current
        if cur is None or cur.depth != self.depth:
            return  # a string inside a value: only the call's own members matter
        if not self._reads_string():
            cur.value_read = True  # another member's value (its text is not held)
            return
        raw = self._slice(self.string_start, i + 1)
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = None
        if cur.key is None:
            cur.key = value if isinstance(value, str) else ""
            return
        cur.value_read = True
        if cur.key == "name":
            if isinstance(value, str):
                cur.name = value
                self._open_call(cur, out)
        else:
            # A string as the arguments (some models write the JSON text quoted): its value
            # is the arguments' text, as in a whole response.
            cur.args_start = self.string_start
            cur.args_sent = i + 1
            cur.pending.append(value if isinstance(value, str) else raw)
            cur.args_done = True
            self._flush_call(cur, out)

    def _end_scalar(self, i: int, out: list) -> None:
        """A number, true, false or null as the arguments ends before ``i``."""
        cur = self.current
        if cur is None or cur.key not in _ARGUMENT_KEYS or cur.args_start >= 0:
            return
        j = self._colon_before(i) + 1
        raw = self._slice(j, i)
        value = raw.strip()
        if value:
            cur.args_start = j + (len(raw) - len(raw.lstrip()))
            self._take(cur, cur.args_start + len(value), out)
            cur.args_done = True

    # -- deltas ----------------------------------------------------------------------------

    def _open_call(self, cur: _Call, out: list) -> None:
        if cur.call is not None or cur.name is None:
            return
        cur.call = ToolCall(cur.name, "")
        cur.index = len(self._calls)
        out.append(cur.call.opening_delta(cur.index))
        self._calls.append(cur.call)
        self._flush_call(cur, out)

    def _take(self, cur: _Call, end: int, out: list) -> None:
        """The arguments' text from where it was sent up to ``end``."""
        start = max(cur.args_start, cur.args_sent)
        if end > start:
            cur.pending.append(self._slice(start, end))
            cur.args_sent = end
        self._flush_call(cur, out)

    def _flush_call(self, cur: _Call, out: list) -> None:
        if cur.call is None or not cur.pending:
            return
        fragment = "".join(cur.pending)
        cur.pending.clear()
        # (Added to ``arguments`` when ``calls`` is read: adding each one copies them all.)
        unsynced = self._unsynced.get(cur.index)
        if unsynced is None:
            self._unsynced[cur.index] = [fragment]
        else:
            unsynced.append(fragment)
        out.append(arguments_delta(cur.index, fragment))

    def _flush_args(self, out: list) -> None:
        """Send the arguments generated so far (an object or array still open)."""
        cur = self.current
        if cur is None or cur.args_start < 0 or cur.args_done:
            return
        # Inside a string too: its characters so far are arguments text.
        self._take(cur, self.pos, out)
