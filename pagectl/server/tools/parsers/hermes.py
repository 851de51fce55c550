"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

import json
import re

from pagectl.server.tools.parsers.base import ToolParser, call_from_object
from pagectl.server.tools.response import ToolCall

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = ("<tool_call>",)
    stream_markers = ("<tool_call>", "</tool_call>")

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find("<tool_call>")
        if start < 0:
            return (text or None), []
        calls = []
        for m in _CALL.finditer(text, start):
            try:
                call = call_from_object(json.loads(m.group(1).strip()))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return (text or None), []
            calls.append(call)
        content = text[:start].strip()
        return (content or None), calls
