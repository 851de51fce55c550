"""The structured-outputs request surface: ``response_format``, vLLM's
``structured_outputs`` and the older ``guided_*`` fields, all mapped onto one
``StructuredOutputsParams``.

``parse_structured`` only reads the fields (cheap, on the event loop); ``check_grammar``
builds the backend's grammar (in a worker thread, by the caller), so a schema, regex or
grammar the backend cannot use is a 400 naming the field, with the backend's message, before
anything reaches the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagectl.engine.structured_outputs.params import (
    StructuredOutputsError,
    StructuredOutputsParams,
    build_grammar,
    canonical_json,
)
from pagectl.server.errors import bad_request

GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "structural_tag": "structural_tag",
}
# vLLM's structured_outputs keys. Refused: whitespace_pattern and
# disable_additional_properties (no such knob in the backend used).
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_SO_REFUSED = ("whitespace_pattern", "disable_additional_properties")
# xgrammar's message for a structural tag that names tokens: only the engine, which has the
# tokenizer's vocabulary, can check it.
_NEEDS_TOKENIZER = "requires tokenizer_info"
_BACKENDS = ("auto", "xgrammar")


@dataclass
class Constraint:
    """A request's constraint and the field it came from (named in a 400)."""

    params: StructuredOutputsParams
    param: str


def not_supported(name: str) -> Exception:
    return bad_request(f"`{name}` is not supported by pagectl", name)


def _response_format(fmt: Any) -> tuple[str, Any] | None:
    if not isinstance(fmt, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", True
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request(
                "response_format.json_schema must be an object with a `schema`",
                "response_format",
            )
        schema = js.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise bad_request(
                "response_format.json_schema.schema must be an object", "response_format"
            )
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request(
                "response_format.json_schema.name must be a string", "response_format"
            )
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(
                "response_format.json_schema.strict must be a boolean", "response_format"
            )
        return "json", schema
    if kind == "structural_tag":
        # vLLM's shape: the response format itself is the tag ("structures" + "triggers",
        # or xgrammar's "format").
        return "structural_tag", fmt
    raise bad_request(
        "response_format.type must be text, json_object, json_schema or structural_tag, "
        f"got {json.dumps(kind)}",
        "response_format",
    )


def _structured_outputs(so: Any) -> tuple[dict[str, Any], bool | None]:
    if not isinstance(so, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    for key in _SO_REFUSED:
        if so.get(key) not in (None, False):
            raise bad_request(
                f"`structured_outputs.{key}` is not supported by pagectl", "structured_outputs"
            )
    found = {k: so[k] for k in _SO_KEYS if so.get(k) not in (None, False)}
    ws = so.get("disable_any_whitespace")
    if ws is not None and not isinstance(ws, bool):
        raise bad_request(
            "structured_outputs.disable_any_whitespace must be a boolean", "structured_outputs"
        )
    fallback = so.get("disable_fallback")
    if fallback is not None and not isinstance(fallback, bool):
        raise bad_request(
            "structured_outputs.disable_fallback must be a boolean", "structured_outputs"
        )
    # disable_fallback is honoured trivially: there is one backend and it never falls back.
    return found, ws


def parse_structured(body: dict) -> Constraint | None:
    """The request's constraint, or None. At most one source may be given."""
    sources: list[tuple[str, str, Any]] = []  # (field, kind, value)
    ws: bool | None = None
    fmt = body.get("response_format")
    if fmt is not None:
        got = _response_format(fmt)
        if got is not None:
            sources.append(("response_format", *got))
    so = body.get("structured_outputs")
    if so is not None:
        found, ws = _structured_outputs(so)
        if len(found) > 1:
            raise bad_request(
                f"structured_outputs takes one of {', '.join(_SO_KEYS)}; got {', '.join(found)}",
                "structured_outputs",
            )
        sources += [("structured_outputs", k, v) for k, v in found.items()]
    for name, kind in GUIDED_FIELDS.items():
        v = body.get(name)
        if v is not None:
            sources.append((name, kind, v))
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in _BACKENDS:
        raise bad_request(
            f"guided_decoding_backend must be one of {', '.join(_BACKENDS)} (pagectl uses "
            f"xgrammar), got {json.dumps(backend)}",
            "guided_decoding_backend",
        )
    if body.get("guided_whitespace_pattern") is not None:
        raise not_supported("guided_whitespace_pattern")
    if body.get("guided_json_object") is not None:
        raise not_supported("guided_json_object")
    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(dict.fromkeys(s[0] for s in sources))
        raise bad_request(f"give one constraint, not several ({names})", sources[1][0])
    field, kind, value = sources[0]
    if kind == "json":
        value = _json_object(field, value, "the JSON schema", (dict, bool))
    if kind == "structural_tag":
        value = _json_object(field, value, "the structural tag", (dict,))
    try:
        params = StructuredOutputsParams(**{kind: value}, disable_any_whitespace=ws)
    except StructuredOutputsError as e:
        raise bad_request(f"{field}: {e}", field) from None
    return Constraint(params, field)


def check_grammar(constraint: Constraint) -> None:
    """Build the backend's grammar; a 400 naming the field with its message when it cannot.
    Runs in a worker thread (a large schema takes a while)."""
    ws = constraint.params.disable_any_whitespace
    try:
        build_grammar(constraint.params, bool(ws))
    except StructuredOutputsError as e:
        if constraint.params.kind == "structural_tag" and _NEEDS_TOKENIZER in str(e):
            return  # the engine's compile checks it (a failure ends the request with it)
        raise bad_request(
            f"{constraint.param}: the constraint cannot be compiled: {e}", constraint.param
        ) from None


def _json_object(field: str, value: object, what: str, types: tuple[type, ...]) -> str:
    """``value`` (an object, or its JSON text) as canonical JSON text; a 400 naming ``field``
    when the text does not parse (nesting too deep for the parser included) or is not one of
    ``types``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as e:
            why = e if isinstance(e, json.JSONDecodeError) else "nested too deep"
            raise bad_request(f"{field}: {what} is not valid JSON: {why}", field) from None
    if not isinstance(value, types):
        raise bad_request(f"{field}: {what} must be an object", field)
    try:
        return canonical_json(value)
    except StructuredOutputsError:
        raise bad_request(f"{field}: {what} is nested too deep", field) from None
