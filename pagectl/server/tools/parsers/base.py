"""The tool-parser interface and the streaming hold-back shared by every parser."""

from __future__ import annotations

import json
from typing import Any

from pagectl.server.tools.response import ToolCall, as_json_text


class ToolParser:
    name = ""
    # Text that opens a tool call in this format.
    start_markers: tuple[str, ...] = ()
    # Marker text around and between calls, skipped when calls are streamed.
    stream_markers: tuple[str, ...] = ()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Split a finished output into content (None when empty) and tool calls. Text
        that looks like a call but does not parse stays in the content."""
        raise NotImplementedError

    def safe_prefix(self, text: str) -> int:
        """How much of a partial output can be streamed as content now: everything before
        the first start marker, less a tail that could be the start of one."""
        cut = len(text)
        for m in self.start_markers:
            i = text.find(m)
            if i >= 0:
                cut = min(cut, i)
        if cut < len(text):
            return cut
        for m in self.start_markers:
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    cut = min(cut, len(text) - k)
                    break
        return cut


def call_from_object(
    obj: Any, args_key: tuple[str, ...] = ("arguments", "parameters")
) -> ToolCall | None:
    """A ``ToolCall`` from ``{"name": ..., "arguments" | "parameters": ...}``, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_key:
        if key in obj:
            return ToolCall(obj["name"], as_json_text(obj[key]))
    return ToolCall(obj["name"], "{}")


def decode_objects(text: str) -> list[Any] | None:
    """Consecutive JSON values in ``text`` (separated by whitespace, ``;`` or ``,``), or
    None when anything else is in the way."""
    dec = json.JSONDecoder()
    out: list[Any] = []
    i = 0
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n;,":
            i += 1
        if i >= n:
            return out
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(obj)
