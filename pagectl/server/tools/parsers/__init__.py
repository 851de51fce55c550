"""Tool-call parsers, by the name ``--tool-call-parser`` takes (vLLM's names).

A parser is a class in its own module with ``name``, ``start_markers`` (text that opens a
tool call; streamed content is held back from the first of them on) and
``extract(text) -> (content, calls)``. Adding one is one module plus a line here.
"""

from __future__ import annotations

from pagectl.server.tools.parsers.base import ToolParser
from pagectl.server.tools.parsers.hermes import HermesToolParser
from pagectl.server.tools.parsers.llama3_json import Llama3JsonToolParser
from pagectl.server.tools.parsers.mistral import MistralToolParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r} (known: {', '.join(sorted(PARSERS))})"
        ) from None
