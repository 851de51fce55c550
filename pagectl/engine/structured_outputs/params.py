"""``StructuredOutputsParams``: the constraint of one request, as vLLM names its fields.

Exactly one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``,
``structural_tag`` is set. The value crosses the process boundary inside ``SamplingParams`` as
a plain dict, so ``json`` and ``structural_tag`` are kept as canonical JSON strings (sorted
keys): equal schemas give equal cache keys.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# Kinds of constraint, in the order their field is checked.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:N: "; clients get the rest.
_BACKEND_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")
# Longest constraint source accepted (schema, regex, grammar or all choices together).
MAX_SOURCE_CHARS = 256 * 1024


class StructuredOutputsError(ValueError):
    """A constraint the backend cannot use; ``param`` names the field at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def backend_message(e: BaseException) -> str:
    """The backend's own message without its source-location prefix."""
    text = str(e).strip()
    return _BACKEND_PREFIX.sub("", text).strip() or type(e).__name__


@dataclass
class StructuredOutputsParams:
    """One request's constraint (see the module docstring)."""

    # A JSON schema, as canonical JSON text (a dict given here is serialised).
    json: str | None = None
    # A regular expression the whole output must match.
    regex: str | None = None
    # The output is exactly one of these strings.
    choice: list[str] | None = None
    # An EBNF grammar (xgrammar / GBNF dialect) with a ``root`` rule.
    grammar: str | None = None
    # Any JSON object.
    json_object: bool = False
    # A structural tag (``structural_tag.py``), as canonical JSON text (a dict is serialised).
    structural_tag: str | None = None
    # True: the JSON grammar admits no free whitespace (compact output; a weak model cannot
    # pad forever). None: the engine's default (--structured-outputs-config).
    disable_any_whitespace: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, list, bool)):
            self.json = canonical_json(self.json)
        if isinstance(self.structural_tag, dict):
            self.structural_tag = canonical_json(self.structural_tag)
        set_kinds = [k for k in KINDS if self._value(k) not in (None, False)]
        if len(set_kinds) != 1:
            raise StructuredOutputsError(
                "structured_outputs",
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag; got {', '.join(set_kinds) or 'none'}",
            )
        if self.choice is not None:
            if (
                not isinstance(self.choice, list)
                or not self.choice
                or not all(isinstance(c, str) for c in self.choice)
            ):
                raise StructuredOutputsError(
                    "structured_outputs", "choice must be a non-empty list of strings"
                )
            self.choice = list(self.choice)
        for k in ("json", "regex", "grammar", "structural_tag"):
            v = self._value(k)
            if v is not None and not isinstance(v, str):
                raise StructuredOutputsError("structured_outputs", f"{k} must be a string")
        if len(self.source) > MAX_SOURCE_CHARS:
            raise StructuredOutputsError(
                "structured_outputs", f"the constraint is longer than {MAX_SOURCE_CHARS} chars"
            )
        if self.disable_any_whitespace is not None and not isinstance(
            self.disable_any_whitespace, bool
        ):
            raise StructuredOutputsError(
                "structured_outputs", "disable_any_whitespace must be a boolean"
            )

    def _value(self, kind: str) -> Any:
        return getattr(self, kind)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._value(k) not in (None, False))

    @property
    def source(self) -> str:
        """The constraint as text (what the cache key is made of)."""
        kind = self.kind
        if kind == "choice":
            return "\x00".join(self.choice or [])
        if kind == "json_object":
            return ""
        return str(self._value(kind))

    def cache_key(self, disable_any_whitespace: bool) -> tuple[str, str, bool]:
        return (self.kind, self.source, disable_any_whitespace)


def canonical_json(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:  # deeper than the encoder goes: a request's value, not a crash
        raise StructuredOutputsError(
            "structured_outputs", "the constraint is nested too deep"
        ) from None


def structural_tag_text(params: StructuredOutputsParams, disable_any_whitespace: bool) -> str:
    """The xgrammar structural tag of a ``structural_tag`` constraint (JSON text)."""
    from pagectl.engine.structured_outputs.structural_tag import normalize

    try:
        return normalize(params.structural_tag, disable_any_whitespace)
    except ValueError as e:
        raise StructuredOutputsError("structured_outputs", str(e)) from None
    except RecursionError:  # a tag nested deeper than the parser and encoder go
        raise StructuredOutputsError(
            "structured_outputs", "structural_tag is nested too deep"
        ) from None


def build_grammar(params: StructuredOutputsParams, disable_any_whitespace: bool) -> Any:
    """The xgrammar ``Grammar`` for ``params`` (no tokenizer needed: the API server runs
    this to refuse a bad constraint with 400). Raises ``StructuredOutputsError``."""
    import xgrammar as xgr

    kind = params.kind
    any_ws = not disable_any_whitespace
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(str(params.json), any_whitespace=any_ws)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_ws)
        if kind == "regex":
            return xgr.Grammar.from_regex(str(params.regex))
        if kind == "choice":
            # JSON string escapes are valid EBNF string literals.
            alternatives = " | ".join(json.dumps(c) for c in params.choice or [])
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(
                structural_tag_text(params, disable_any_whitespace)
            )
        return xgr.Grammar.from_ebnf(str(params.grammar))
    except StructuredOutputsError:
        raise
    except Exception as e:  # the backend raises RuntimeError / ValueError with its message
        raise StructuredOutputsError("structured_outputs", backend_message(e)) from None
