"""Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` after any content."""

from __future__ import annotations

import json

from pagectl.server.tools.parsers.base import ToolParser, call_from_object
from pagectl.server.tools.response import ToolCall

_MARK = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    start_markers = (_MARK,)
    stream_markers = (_MARK,)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(_MARK)
        if start < 0:
            return (text or None), []
        payload = text[start + len(_MARK) :].strip()
        try:
            items = json.loads(payload)
        except json.JSONDecodeError:
            return (text or None), []
        if isinstance(items, dict):
            items = [items]
        calls = [call_from_object(it) for it in items] if isinstance(items, list) else []
        if not calls or any(c is None for c in calls):
            return (text or None), []
        content = text[:start].strip()
        return (content or None), [c for c in calls if c is not None]
