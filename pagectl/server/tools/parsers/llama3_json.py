"""Llama 3.1+ JSON tool calls: the output is ``{"name": ..., "parameters": {...}}`` (several
separated by ``;``), optionally after ``<|python_tag|>``."""

from __future__ import annotations

from pagectl.server.tools.parsers.base import ToolParser, call_from_object, decode_objects
from pagectl.server.tools.response import ToolCall

_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_markers = (_TAG, "{")
    stream_markers = (_TAG,)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(_TAG):
            body = body[len(_TAG) :]
        if not body.lstrip().startswith("{"):
            return (text or None), []
        objs = decode_objects(body)
        calls = [call_from_object(o) for o in objs] if objs else []
        if not calls or any(c is None for c in calls):
            return (text or None), []
        return None, [c for c in calls if c is not None]

    def safe_prefix(self, text: str) -> int:
        # A call is the whole output: hold back from the first non-space character when it
        # may open one.
        stripped = text.lstrip()
        if not stripped or stripped[0] == "{" or _TAG.startswith(stripped[: len(_TAG)]):
            return 0
        return len(text)
