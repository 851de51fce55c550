"""``tools``, ``tool_choice``, ``parallel_tool_calls`` of a chat request.

``tool_choice``:
- ``"none"``: the tools are shown to the template, the output is plain text.
- ``"auto"`` (the default when tools are given): plain generation; the daemon's
  ``--tool-call-parser`` finds calls in the text. Refused unless the daemon runs with
  ``--enable-auto-tool-choice``.
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}``
  calls (one item when ``parallel_tool_calls`` is false), so any model calls a tool.
- ``{"type": "function", "function": {"name": N}}``: the output is constrained to N's
  ``parameters`` schema; it is the call's arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagectl.engine.structured_outputs.params import StructuredOutputsParams, canonical_json
from pagectl.server.errors import bad_request

MAX_TOOLS = 128


@dataclass
class ToolSpec:
    """What a chat request asked of tools."""

    # The tools as the template sees them ({"type": "function", "function": {...}}).
    tools: list[dict[str, Any]] = field(default_factory=list)
    # "none", "auto", "required" or "named".
    mode: str = "none"
    # The function forced by a named tool_choice.
    name: str | None = None
    parallel: bool = True

    def parameters(self, name: str) -> dict:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object", "properties": {}}
        raise KeyError(name)

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured-outputs constraint that enforces a required or named choice."""
        if self.mode == "named":
            assert self.name is not None
            return StructuredOutputsParams(json=canonical_json(self.parameters(self.name)))
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": t["function"].get("parameters")
                    or {"type": "object", "properties": {}},
                },
                "required": ["name", "parameters"],
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=canonical_json(schema))


def _tool(t: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        raise bad_request(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
    fn = t.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(f"{where}.function needs a string `name`", "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object", "tools")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise bad_request(f"{where}.function.description must be a string", "tools")
    out = {"name": fn["name"]}
    if desc is not None:
        out["description"] = desc
    if params is not None:
        out["parameters"] = params
    if fn.get("strict") is not None:
        out["strict"] = bool(fn["strict"])
    return {"type": "function", "function": out}


def parse_tools(body: dict, auto_enabled: bool) -> ToolSpec:
    if body.get("functions") is not None or body.get("function_call") is not None:
        name = "functions" if body.get("functions") is not None else "function_call"
        raise bad_request(f"`{name}` is not supported by pagectl (use tools and tool_choice)", name)
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise bad_request("tools must be a list", "tools")
    raw = raw or []
    if len(raw) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools per request", "tools")
    tools = [_tool(t, i) for i, t in enumerate(raw)]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", "tools")
    par = body.get("parallel_tool_calls")
    if par is not None and not isinstance(par, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    spec = ToolSpec(tools, parallel=par is not False)
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(
                'tool_choice must be "none", "auto", "required" or {"type": "function", '
                f'"function": {{"name": ...}}}}, got {json.dumps(choice)}',
                "tool_choice",
            )
        spec.mode = choice
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(
                'a named tool_choice is {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if fn.get("name") not in names:
            raise bad_request(
                f"tool_choice names {json.dumps(fn.get('name'))}, which is not in tools",
                "tool_choice",
            )
        spec.mode = "named"
        spec.name = fn["name"]
    else:
        raise bad_request("tool_choice must be a string or an object", "tool_choice")
    if spec.mode != "none" and not tools:
        raise bad_request(f"tool_choice {json.dumps(choice)} needs tools", "tool_choice")
    if spec.mode == "auto" and tools and not auto_enabled:
        raise bad_request(
            '"auto" tool choice requires the daemon to run with --enable-auto-tool-choice '
            "and --tool-call-parser",
            "tool_choice",
        )
    return spec
