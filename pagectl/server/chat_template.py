"""Chat templates rendered in jinja2's immutable sandbox, with a time and an output limit.

Every template goes through here: the model's own, the daemon's ``--chat-template``, and a
client's per-request ``chat_template`` (refused unless the daemon trusts them). The sandbox
blocks attribute tricks; the limits stop a template that loops or writes without end:
``range`` counts every step it hands out and every sandboxed call or attribute read checks
the clock, so a render past ``TIME_LIMIT_S`` or ``MAX_OUTPUT_CHARS`` fails with a 400.
Renders run in a worker thread (the caller's job), never on the event loop.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

TIME_LIMIT_S = 2.0
MAX_OUTPUT_CHARS = 4 * 1024 * 1024
MAX_RANGE = 100_000


class TemplateError(ValueError):
    """The template failed, or went past a limit."""


def load_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text when ``value`` is a path, else the template text."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a template")
    return value


def _make_env() -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def __init__(self) -> None:
            super().__init__(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            # Renders run in several worker threads at once: each has its own deadline.
            self.local = threading.local()

        def check(self) -> None:
            if time.monotonic() > getattr(self.local, "deadline", float("inf")):
                raise TemplateError(f"the chat template ran longer than {TIME_LIMIT_S} s")

        def call(self, __context, __obj, *args, **kwargs):  # type: ignore[override]
            self.check()
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj, attribute):  # type: ignore[override]
            self.check()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):  # type: ignore[override]
            self.check()
            return super().getitem(obj, argument)

        def call_binop(self, context, operator, left, right):  # type: ignore[override]
            self.check()
            if operator == "*":
                seq, times = (left, right) if isinstance(right, int) else (right, left)
                if (
                    isinstance(seq, (str, list))
                    and isinstance(times, int)
                    and len(seq) * times > MAX_OUTPUT_CHARS
                ):
                    raise TemplateError("the chat template builds a value that is too large")
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                raise TemplateError("the chat template raises a number to too large a power")
            return super().call_binop(context, operator, left, right)

    env = _Env()

    def limited_range(*args: int):
        r = range(*args)
        if len(r) > MAX_RANGE:
            raise TemplateError(f"range() of more than {MAX_RANGE} items in the chat template")
        for i in r:
            env.check()
            yield i

    def raise_exception(message: str) -> None:
        raise TemplateError(str(message))

    def tojson(
        value: Any, indent: int | None = None, separators=None, sort_keys=False, ensure_ascii=False
    ) -> str:
        return json.dumps(
            value,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
            ensure_ascii=ensure_ascii,
        )

    env.globals["range"] = limited_range
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = tojson
    return env


_ENV: Any = None


def _env() -> Any:
    global _ENV
    if _ENV is None:
        _ENV = _make_env()
    return _ENV


@lru_cache(maxsize=64)
def _compile(source: str) -> Any:
    return _env().from_string(source)


def render(source: str, variables: dict[str, Any]) -> str:
    """Render ``source`` with ``variables``; ``TemplateError`` on failure or past a limit."""
    from jinja2 import TemplateError as JinjaError

    env = _env()
    try:
        template = _compile(source)
    except JinjaError as e:
        raise TemplateError(f"the chat template does not parse: {e}") from None
    env.local.deadline = time.monotonic() + TIME_LIMIT_S
    out: list[str] = []
    size = 0
    try:
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > MAX_OUTPUT_CHARS:
                raise TemplateError(
                    f"the chat template wrote more than {MAX_OUTPUT_CHARS} characters"
                )
            out.append(chunk)
    except TemplateError:
        raise
    except JinjaError as e:
        raise TemplateError(f"the chat template failed: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
        raise TemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
    finally:
        env.local.deadline = float("inf")
    return "".join(out)


def template_variables(tokenizer: Any) -> dict[str, Any]:
    """The special tokens a Hugging Face template expects (bos_token, eos_token, ...)."""
    out: dict[str, Any] = {}
    if tokenizer is None:
        return out
    for key, value in (getattr(tokenizer, "special_tokens_map", None) or {}).items():
        if isinstance(value, str):
            out[key] = value
    return out


def model_template(tokenizer: Any, tools: bool) -> str | None:
    """The tokenizer's template (the "tool_use" one when tools are given and it has one)."""
    t = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(t, dict):
        return t.get("tool_use") if tools and "tool_use" in t else t.get("default")
    return t
