"""Structural tags: free text with tagged regions whose content follows a format (xgrammar's
structural tag).

Two shapes are accepted, as vLLM accepts them:
- vLLM's original one: ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``
  (``"type": "structural_tag"`` optional). Any text until a trigger appears; a trigger must
  go on as the ``begin`` of one of the structures, then JSON for its ``schema``, then its
  ``end``; free text again after it. It is translated here into xgrammar's
  ``triggered_tags`` format (what xgrammar itself does with it).
- xgrammar's: ``{"type": "structural_tag", "format": {...}}`` (``tag``, ``sequence``,
  ``or``, ``triggered_tags``, ``json_schema``, ``regex``, ``grammar``, ...), passed as is.

``normalize`` gives the canonical JSON text of the xgrammar form; it raises ``ValueError``
with a message that names the key at fault.
"""

from __future__ import annotations

import json
from typing import Any

# Whitespace allowed in a row inside a JSON region when any whitespace is disabled and the
# region does not set its own bound (xgrammar's smallest bound is 1).
COMPACT_MAX_WHITESPACE = 1


def _legacy(tag: dict[str, Any]) -> dict[str, Any]:
    structures = tag.get("structures")
    triggers = tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag.structures must be a non-empty list")
    if (
        not isinstance(triggers, list)
        or not triggers
        or not all(isinstance(t, str) and t for t in triggers)
    ):
        raise ValueError("structural_tag.triggers must be a non-empty list of strings")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict):
            raise ValueError(f"structural_tag.structures[{i}] must be an object")
        _refuse_unknown(s, _STRUCTURE_KEYS, f"structural_tag.structures[{i}]")
        begin, end = s.get("begin"), s.get("end")
        if not isinstance(begin, str) or not begin or not isinstance(end, str):
            raise ValueError(
                f"structural_tag.structures[{i}] needs string `begin` (non-empty) and `end`"
            )
        schema = s.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"structural_tag.structures[{i}].schema must be a JSON schema")
        if not any(begin.startswith(t) for t in triggers):
            raise ValueError(
                f"structural_tag.structures[{i}].begin {json.dumps(begin)} starts with none "
                "of the triggers"
            )
        tags.append(
            {
                "type": "tag",
                "begin": begin,
                "content": {"type": "json_schema", "json_schema": schema},
                "end": end,
            }
        )
    fmt = {"type": "triggered_tags", "triggers": triggers, "tags": tags}
    return {"type": "structural_tag", "format": fmt}


def _bound_whitespace(node: Any) -> None:
    """Give every JSON region without its own ``max_whitespace_cnt`` the compact bound."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            node.setdefault("max_whitespace_cnt", COMPACT_MAX_WHITESPACE)
        for key, value in node.items():
            if key != "json_schema":  # a schema's own keywords are not formats
                _bound_whitespace(value)
    elif isinstance(node, list):
        for value in node:
            _bound_whitespace(value)


# The keys each form takes; any other is refused rather than ignored.
_LEGACY_KEYS = frozenset({"type", "structures", "triggers"})
_FORMAT_KEYS = frozenset({"type", "format"})
_STRUCTURE_KEYS = frozenset({"begin", "schema", "end"})


def _refuse_unknown(obj: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    extra = sorted(k for k in obj if k not in allowed)
    if extra:
        names = ", ".join(json.dumps(k)[:80] for k in extra[:5])
        raise ValueError(f"{where} does not take {names}")


def normalize(value: Any, disable_any_whitespace: bool) -> str:
    """The xgrammar structural tag (canonical JSON text) for a request's ``value`` (an object
    or its JSON text)."""
    parsed = isinstance(value, str)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structural_tag is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("structural_tag must be an object")
    kind = value.get("type", "structural_tag")
    if kind != "structural_tag":
        raise ValueError(f'structural_tag.type must be "structural_tag", got {json.dumps(kind)}')
    if "structures" in value or "triggers" in value:
        _refuse_unknown(value, _LEGACY_KEYS, "structural_tag (with structures and triggers)")
        tag = _legacy(value)
    elif isinstance(value.get("format"), dict):
        _refuse_unknown(value, _FORMAT_KEYS, "structural_tag (with a format)")
        # Whitespace bounds are set in place: a caller's own object is copied first.
        fmt = value["format"] if parsed else json.loads(json.dumps(value["format"]))
        tag = {"type": "structural_tag", "format": fmt}
    else:
        raise ValueError(
            "structural_tag needs `structures` and `triggers` (vLLM's form) or a `format` "
            "object (xgrammar's)"
        )
    if disable_any_whitespace:
        _bound_whitespace(tag["format"])
    # params.canonical_json's form (params imports this module: not imported back).
    return json.dumps(tag, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
