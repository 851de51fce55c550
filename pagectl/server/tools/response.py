"""Tool calls in responses: OpenAI's ``tool_calls`` objects and streaming deltas."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolCall:
    name: str
    # The arguments as a JSON text (what OpenAI's ``function.arguments`` holds).
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def message(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def opening_delta(self, index: int) -> dict[str, Any]:
        """The first delta of a streamed call: index, id, type and name."""
        return {
            "index": index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": ""},
        }


def arguments_delta(index: int, fragment: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": fragment}}


def as_json_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def calls_from_required(text: str) -> list[ToolCall] | None:
    """Calls from a ``"required"`` output (a JSON array of {"name", "parameters"}); None
    when the text is not such an array (cut short by max_tokens, say)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list):
        return None
    calls = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            return None
        calls.append(ToolCall(it["name"], as_json_text(it.get("parameters", {}))))
    return calls
