"""What a chat choice's text becomes in a response: reasoning split off (``--reasoning-parser``),
tool calls found (required / named tool choice, or ``auto`` with ``--tool-call-parser``), and
the streaming deltas for both, per choice.

Streaming rules: reasoning text goes out as ``reasoning_content`` deltas; tool calls go out
as they are generated, as OpenAI streams them (a first delta with the call's index, id, type
and name, then argument fragments): with a named tool choice the output is the call's
arguments; with ``required`` (a JSON array of calls) and with ``auto`` from the first
tool-call marker on, ``tools/streaming.py`` reads the calls from the growing text. With
``auto``, content before the marker streams as it comes; text after the marker is never
content once a call went out. A choice cut short (``length``) keeps the partial calls it
streamed; one that streamed no call sends its held text as content at the end.
"""

from __future__ import annotations

from typing import Any

from pagectl.server import reasoning
from pagectl.server.tools.parsers import get_parser
from pagectl.server.tools.request import ToolSpec
from pagectl.server.tools.response import ToolCall, arguments_delta, calls_from_required
from pagectl.server.tools.streaming import CallScanner


class ChatOutput:
    """How one request's choices are turned into messages and deltas."""

    def __init__(
        self, tools: ToolSpec | None, tool_parser: str | None, reasoning_parser: str | None
    ):
        self.mode = tools.mode if tools is not None else "none"
        self.name = tools.name if tools is not None else None
        self.parser = get_parser(tool_parser) if (self.mode == "auto" and tool_parser) else None
        if self.mode == "auto" and self.parser is None:
            self.mode = "none"
        self.reasoning_parser = reasoning_parser

    # -- whole outputs ------------------------------------------------------------------

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The ``message`` of a finished choice and its (possibly changed) finish_reason."""
        reasoning_text = None
        content: str | None = text
        if self.reasoning_parser:
            reasoning_text, content = reasoning.split(self.reasoning_parser, text)
        calls, content = self._calls(content or "", finish_reason)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning_parser:
            msg["reasoning_content"] = reasoning_text
        if calls:
            msg["tool_calls"] = [c.message() for c in calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return msg, finish_reason

    def _calls(self, content: str, finish_reason: str | None) -> tuple[list[ToolCall], str | None]:
        if self.mode == "named" and finish_reason == "stop":
            assert self.name is not None
            return [ToolCall(self.name, content)], None
        if self.mode == "required" and finish_reason == "stop":
            calls = calls_from_required(content)
            if calls:
                return calls, None
        if self.mode == "auto" and self.parser is not None:
            text, calls = self.parser.extract(content)
            if calls:
                return calls, text
        return [], (content if content != "" or self.mode == "none" else content)

    # -- streaming ----------------------------------------------------------------------

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """Delta state of one streamed choice."""

    def __init__(self, out: ChatOutput) -> None:
        self.out = out
        self.reasoning = (
            reasoning.ReasoningStream(out.reasoning_parser) if out.reasoning_parser else None
        )
        self.content = ""  # content text seen (after reasoning was split off)
        self.sent = 0  # of it, sent as content deltas
        self.named_call: ToolCall | None = None
        # Required and auto: reads calls from the text (auto: from the first marker on).
        self.scanner: CallScanner | None = CallScanner() if out.mode == "required" else None

    def push(
        self, text: str, finished: bool, finish_reason: str | None
    ) -> tuple[list[dict], str | None]:
        """Delta dicts for new text (content / reasoning_content / tool_calls), and the
        finish_reason to report when ``finished``."""
        deltas: list[dict] = []
        if self.reasoning is not None:
            r, c = self.reasoning.push(text, final=finished)
            if r:
                deltas.append({"reasoning_content": r})
        else:
            c = text
        mode = self.out.mode
        self.content += c
        if mode == "none":
            if c or (not finished and not deltas):
                deltas.append({"content": c})  # one event per engine output, as before
            self.sent = len(self.content)
            return deltas, finish_reason
        if mode == "named":
            if c or (finished and self.named_call is None and finish_reason == "stop"):
                if self.named_call is None:
                    assert self.out.name is not None
                    self.named_call = ToolCall(self.out.name, "")
                    deltas.append({"tool_calls": [self.named_call.opening_delta(0)]})
                if c:
                    deltas.append({"tool_calls": [arguments_delta(0, c)]})
            if finished and finish_reason == "stop":
                finish_reason = "tool_calls"
            return deltas, finish_reason
        if self.scanner is not None:
            fed = c
        else:
            fed = self._auto_content(deltas)  # auto: the content before a marker goes out
        if self.scanner is not None and fed:
            deltas += [{"tool_calls": [d]} for d in self.scanner.feed(fed)]
        if not finished:
            return deltas, finish_reason
        streamed = self.scanner.calls if self.scanner is not None else []
        if not streamed:
            calls, _ = self.out._calls(self.content, finish_reason)
            for i, call in enumerate(calls):  # (never expected: the scanner found none)
                deltas.append({"tool_calls": [call.opening_delta(i)]})
                deltas.append({"tool_calls": [arguments_delta(i, call.arguments)]})
            streamed = calls
        if streamed:
            self.sent = len(self.content)
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        elif self.sent < len(self.content):
            deltas.append({"content": self.content[self.sent :]})
            self.sent = len(self.content)
        return deltas, finish_reason

    def _auto_content(self, deltas: list[dict]) -> str:
        """Auto tool choice: stream the content that cannot be a call; once a whole start
        marker is seen, start the scanner there. Returns the text for the scanner."""
        parser = self.out.parser
        assert parser is not None
        safe = parser.safe_prefix(self.content)
        if safe > self.sent:
            deltas.append({"content": self.content[self.sent : safe]})
            self.sent = safe
        rest = self.content[safe:]
        if any(rest.lstrip().startswith(m) for m in parser.start_markers):
            self.scanner = CallScanner(parser.stream_markers)
            return rest
        return ""
