"""Tokenizer loading and incremental detokenization with stop strings.

Used wherever text is produced: the offline ``LLM`` and the API server. The engine core itself
works on token ids only.
"""

from __future__ import annotations

import os
from typing import Any

from pagectl.engine.sampling_params import SamplingParams

# Prompt tokens kept as decoding context, so the first output token decodes with the right
# leading space (SentencePiece) and byte-level merges.
_CONTEXT_TOKENS = 6


def load_tokenizer(path: str | os.PathLike, *, trust_remote_code: bool = False) -> Any | None:
    """The Hugging Face tokenizer at ``path``, or None when the directory has none.

    A model directory without tokenizer files still serves token-id prompts.
    """
    p = str(path)
    if os.path.isdir(p):
        names = set(os.listdir(p))
        if not names & {"tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json"}:
            return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(p, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        if os.path.isdir(p):
            return None
        raise


def apply_chat_template(tokenizer: Any, messages: list[dict], **kwargs: Any) -> list[int]:
    """Token ids of ``messages`` rendered by the model's chat template (generation prompt on)."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so chat is not available")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    kwargs.setdefault("add_generation_prompt", True)
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    if hasattr(out, "keys") and "input_ids" in out:  # transformers v5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


class IncrementalDetokenizer:
    """Turns one sequence's new token ids into new text, and finds stop strings.

    Text that could be the start of a stop string is held back until it is known not to be
    one, so a stop string never reaches the client even across token boundaries. When a stop
    string is found, ``stop_hit`` is set and the text is cut before it (or after it with
    ``include_stop_str_in_output``).
    """

    def __init__(self, tokenizer: Any | None, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        self.include_stop = params.include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._tokens = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        # Full output text so far (cut at a stop string once found).
        self.text = ""
        # Characters of ``text`` already handed out by ``push``/``flush``.
        self._emitted = 0
        self.stop_hit: str | None = None

    def _decode(self, ids: list[int]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_token_ids: list[int]) -> str:
        """Feed new tokens; returns the text that is now safe to emit."""
        if self.tokenizer is None or self.stop_hit is not None:
            return ""
        toks = self._tokens
        toks.extend(new_token_ids)
        prefix_text = self._decode(toks[self._prefix_offset : self._read_offset])
        full_text = self._decode(toks[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for more bytes
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(toks)
        self._append(delta)
        if self.stop_hit is not None or not self.stop:
            return self._take(len(self.text))
        return self._take(len(self.text) - self._hold)

    def push_run(self, new_token_ids: list[int]) -> tuple[str, int]:
        """Like ``push`` for a run of several tokens (speculative decoding), but stops at the
        token that completes a stop string. Returns the text and how many of the tokens
        count (all of them unless a stop string ended the run inside it), so the output is
        the same as when the tokens arrive one by one."""
        if not self.stop or len(new_token_ids) <= 1:
            return self.push(new_token_ids), len(new_token_ids)
        text = ""
        for i, t in enumerate(new_token_ids):
            text += self.push([t])
            if self.stop_hit is not None:
                return text, i + 1
        return text, len(new_token_ids)

    def _append(self, delta: str) -> None:
        """Add decoded text and look for a stop string in what could newly match."""
        search_from = max(0, len(self.text) - self._hold)
        self.text += delta
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.stop_hit = s
            self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]

    def flush(self) -> str:
        """At the end of the sequence: whatever was held back.

        Tokens that ended inside an incomplete UTF-8 sequence are decoded now (with
        replacement characters), so the final text equals a full decode of the output.
        """
        if (
            self.tokenizer is not None
            and self.stop_hit is None
            and self._read_offset < len(self._tokens)
        ):
            toks = self._tokens
            prefix_text = self._decode(toks[self._prefix_offset : self._read_offset])
            full_text = self._decode(toks[self._prefix_offset :])
            self._prefix_offset = self._read_offset = len(toks)
            if len(full_text) > len(prefix_text):
                self._append(full_text[len(prefix_text) :])
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self.text[self._emitted : upto]
        self._emitted = upto
        return out
