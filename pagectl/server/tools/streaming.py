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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagectl.server.tools.response import ToolCall, arguments_delta

_ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class _Call:
    """A call object being read."""

    depth: int  # the scanner's depth inside this object
    key: str | None = None  # the member being read (None: its key comes next)
    value_read: bool = False  # the member's value was a string, already read
    name: str | None = None
    call: ToolCall | None = None  # set once the opening delta went out
    index: int = -1  # the call's index in the choice's tool_calls
    args_start: int = -1  # where the arguments' value starts in the text
    args_sent: int = -1  # how far the arguments were sent (text index)
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
        self.text = ""
        self.pos = 0  # next character to scan
        self.depth = 0  # JSON nesting depth (objects and arrays)
        self.in_string = False
        self.escape = False
        self.string_start = -1  # where the current string token starts (its quote)
        self.last_string: str | None = None  # the last complete string at any depth
        self.top_array = False  # the current top-level value is an array
        self.current: _Call | None = None
        self.calls: list[ToolCall] = []  # calls whose opening delta went out, in order
        self.scalar_start = -1  # an arguments value that is not an object or array

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Tool-call delta entries (each one ``delta.tool_calls`` element) for new text."""
        self.text += text
        out: list[dict[str, Any]] = []
        t = self.text
        n = len(t)
        i = self.pos
        while i < n:
            ch = t[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    self._string_end(i, out)
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
                    self._open(ch, i, out)
                i += 1
                continue
            if ch == '"':
                self.in_string = True
                self.string_start = i
            elif ch in "{[":
                self._open(ch, i, out)
            elif ch in "}]":
                self._close(i, out)
            elif ch == ",":
                self._comma(i, out)
            i += 1
        self.pos = i
        self._flush_args(out)
        return out

    # -- structure -------------------------------------------------------------------------

    def _marker_at(self, i: int) -> int | None:
        """Length of the marker at ``i`` (0: none; None: the text ends inside one)."""
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
        try:
            value = json.loads(self.text[self.string_start : i + 1])
        except json.JSONDecodeError:
            value = None
        if cur.key is None:
            cur.key = value if isinstance(value, str) else ""
            return
        if cur.value_read:
            return
        cur.value_read = True
        if cur.key == "name" and cur.name is None and isinstance(value, str):
            cur.name = value
            self._open_call(cur, out)
        elif cur.key in _ARGUMENT_KEYS and cur.args_start < 0:
            # A string as the arguments (some models write the JSON text quoted): its value
            # is the arguments' text, as in a whole response.
            cur.args_start = self.string_start
            cur.args_sent = i + 1
            cur.pending.append(
                value if isinstance(value, str) else self.text[cur.args_start : i + 1]
            )
            cur.args_done = True
            self._flush_call(cur, out)

    def _end_scalar(self, i: int, out: list) -> None:
        """A number, true, false or null as the arguments ends before ``i``."""
        cur = self.current
        if cur is None or cur.key not in _ARGUMENT_KEYS or cur.args_start >= 0:
            return
        j = self.text.rfind(":", 0, i) + 1
        value = self.text[j:i].strip()
        if value:
            cur.args_start = j + (len(self.text[j:i]) - len(self.text[j:i].lstrip()))
            self._take(cur, cur.args_start + len(value), out)
            cur.args_done = True

    # -- deltas ----------------------------------------------------------------------------

    def _open_call(self, cur: _Call, out: list) -> None:
        if cur.call is not None or cur.name is None:
            return
        cur.call = ToolCall(cur.name, "")
        cur.index = len(self.calls)
        out.append(cur.call.opening_delta(cur.index))
        self.calls.append(cur.call)
        self._flush_call(cur, out)

    def _take(self, cur: _Call, end: int, out: list) -> None:
        """The arguments' text from where it was sent up to ``end``."""
        start = max(cur.args_start, cur.args_sent)
        if end > start:
            cur.pending.append(self.text[start:end])
            cur.args_sent = end
        self._flush_call(cur, out)

    def _flush_call(self, cur: _Call, out: list) -> None:
        if cur.call is None or not cur.pending:
            return
        fragment = "".join(cur.pending)
        cur.pending.clear()
        cur.call.arguments += fragment
        out.append(arguments_delta(cur.index, fragment))

    def _flush_args(self, out: list) -> None:
        """Send the arguments generated so far (an object or array still open)."""
        cur = self.current
        if cur is None or cur.args_start < 0 or cur.args_done:
            return
        # Inside a string too: its characters so far are arguments text.
        self._take(cur, self.pos, out)
