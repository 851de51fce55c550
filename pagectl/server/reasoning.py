"""Reasoning parsers (``--reasoning-parser``): the text inside ``<think>...</think>`` goes to
``reasoning_content``, the rest to ``content``.

- ``qwen3``: reasoning only when the output opens with ``<think>`` (Qwen3 with thinking off
  writes none), up to ``</think>``.
- ``deepseek_r1``: the output starts inside the reasoning (the template opened
  ``<think>``; an opening tag the model writes itself is dropped): everything before
  ``</think>`` is reasoning, even when the output ends before it.

``ReasoningStream`` splits a streamed output exactly as ``split`` does, holding back a tail
that could be the start of a tag.
"""

from __future__ import annotations

PARSERS = ("qwen3", "deepseek_r1")
_OPEN = "<think>"
_CLOSE = "</think>"


def split(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a finished output."""
    s = ReasoningStream(parser)
    r, c = s.push(text, final=True)
    return (r or None), (c or None)


class ReasoningStream:
    """Incremental ``split`` for one streamed choice."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.buffer = ""  # text not yet given to a side
        # None: not known yet (before the first non-space text); then True / False.
        self.in_reasoning: bool | None = None

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) for new text; ``final`` flushes."""
        self.buffer += text
        if self.in_reasoning is None:
            head = self.buffer.lstrip()
            if not final and len(head) < len(_OPEN) and _OPEN.startswith(head):
                return "", ""  # could still be an opening tag
            if head.startswith(_OPEN):
                self.buffer = head[len(_OPEN) :]
                self.in_reasoning = True
            else:
                self.in_reasoning = self.parser == "deepseek_r1"
        if not self.in_reasoning:
            content, self.buffer = self.buffer, ""
            return "", content
        i = self.buffer.find(_CLOSE)
        if i >= 0:
            reasoning, content = self.buffer[:i], self.buffer[i + len(_CLOSE) :]
            self.buffer = ""
            self.in_reasoning = False
            return reasoning, content
        keep = 0 if final else _partial(self.buffer, _CLOSE)
        cut = len(self.buffer) - keep
        reasoning, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return reasoning, ""


def _partial(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that starts ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
