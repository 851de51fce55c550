"""Engine outputs -> text, tokens, finish reasons and usage, for the offline ``LLM`` and the
HTTP server alike.

Each rule is written once, here:

- Text: a sample's new tokens go through its ``IncrementalDetokenizer``; when the sample ends
  (other than at a stop string), whatever the detokenizer held back is flushed, so the text
  equals a full decode of the output.
- Stop strings are found here (the engine only knows stop token ids). A hit ends the sample
  with finish_reason "stop" and the string as stop_reason; when the engine had not ended the
  sequence itself, the update's ``stop_in_engine`` says so and the caller must tell the engine
  (``EngineCore.finish_by_stop_string`` or the engine client's ``finish_stop_string``).
  Outputs that arrive for a sample after it ended are dropped.
- Cached tokens: a request's count is the largest any of its outputs reported.
- Prompt logprobs: the chunks of every output are concatenated in arrival order.
- Finish reasons are the engine's, except a stop string found here. An engine "error" ends
  the sample with finish_reason "error" and the engine's message in ``error``; the caller
  decides how to report it (the LLM returns it, the HTTP server answers with an error).

Not thread-safe: one processor per caller (the LLM's thread, one HTTP request's task).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagectl.engine.outputs import EngineCoreOutput, TokenLogprobs
from pagectl.engine.sampling_params import SamplingParams
from pagectl.engine.tokenizer import IncrementalDetokenizer

# The message of an "error" finish the engine gave no reason for.
UNKNOWN_ERROR = "the request failed in the engine"
# Shared, never changed: the logprobs of an output that carries none.
_NO_LOGPROBS: list[TokenLogprobs] = []


@dataclass(slots=True)
class SampleState:
    """One of a request's n samples, as output so far."""

    # Index among the request's samples (the engine's ``index``).
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    # Logprobs of each generated token, when the request asked for them.
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # "stop", "length", "abort" or "error" once ended, else None.
    finish_reason: str | None = None
    # The stop string or stop token id that ended it, if any.
    stop_reason: int | str | None = None
    # The engine's message when finish_reason == "error".
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The full text so far (cut at a stop string once found)."""
        return self.detok.text


@dataclass(slots=True)
class RequestState:
    """One engine request: one prompt and its samples."""

    request_id: str
    prompt_token_ids: list[int]
    samples: list[SampleState]
    # Prompt tokens served by the prefix cache (the largest count reported).
    num_cached_tokens: int = 0
    # Logprobs of prompt tokens 1.. (the first prompt token has none), when asked for.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_finished: int = 0

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.samples)


@dataclass(slots=True)
class SampleUpdate:
    """What one engine output changed for one sample."""

    request: RequestState
    sample: SampleState
    # Text that is now safe to show (held-back text included on the last update).
    text: str
    # The output's new tokens and their logprobs (its own lists: read, never change them).
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    # True on the sample's last update (its finish_reason is set).
    finished: bool
    # A stop string that ended the sample here while the engine still runs the sequence:
    # the caller must finish it in the engine.
    stop_in_engine: str | None = None


class OutputProcessor:
    """Applies engine outputs to the requests added here (see the module docstring).

    Args:
        tokenizer: the Hugging Face tokenizer, or None (no text: only token ids).
    """

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestState:
        """Track a request with ``params.n`` samples; returns its state. With
        ``params.detokenize`` off its samples get no text."""
        tokenizer = self.tokenizer if params.detokenize else None
        samples = [
            SampleState(i, IncrementalDetokenizer(tokenizer, prompt_token_ids, params))
            for i in range(params.n)
        ]
        state = RequestState(request_id, prompt_token_ids, samples)
        self.requests[request_id] = state
        return state

    def process(self, out: EngineCoreOutput) -> SampleUpdate | None:
        """Apply one output. None when it changed nothing visible (an unknown request, a
        sample that already ended, an output with no token that does not end the sample)."""
        req = self.requests.get(out.request_id)
        if req is None:
            return None
        if out.num_cached_tokens > req.num_cached_tokens:
            req.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs:
            req.prompt_logprobs.extend(out.prompt_logprobs)
        sample = req.samples[out.index]
        if sample.finish_reason is not None:
            return None
        new = out.new_token_ids
        lps = out.new_logprobs or _NO_LOGPROBS
        text = ""
        if new:
            # A speculative run stops at the token that completes a stop string: the later
            # tokens of the run are dropped, as if they had arrived one by one.
            text, num = sample.detok.push_run(new)
            if num < len(new):
                new = new[:num]
                lps = lps[:num]
            sample.token_ids.extend(new)
            if lps:
                sample.logprobs.extend(lps)
        stop = sample.detok.stop_hit
        stop_in_engine = None
        if stop is not None:
            self._finish(req, sample, "stop", stop)
            if out.finish_reason is None:
                stop_in_engine = stop
        elif out.finish_reason is not None:
            text += sample.detok.flush()
            self._finish(req, sample, out.finish_reason, out.stop_reason)
            if out.finish_reason == "error":
                sample.error = out.error or UNKNOWN_ERROR
        elif not new:
            return None
        return SampleUpdate(req, sample, text, new, lps, sample.finished, stop_in_engine)

    @staticmethod
    def _finish(
        req: RequestState, sample: SampleState, reason: str, stop_reason: int | str | None
    ) -> None:
        sample.finish_reason = reason
        sample.stop_reason = stop_reason
        req.num_finished += 1
