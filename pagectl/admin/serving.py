"""One HTTP generation request in flight: its engine requests, its choices, their text.

A request with P prompts and n samples is P engine requests; choice ``p * n + i`` is sample
``i`` of prompt ``p`` (OpenAI's numbering). Outputs arrive on one queue in engine order; each
is applied to its choice: tokens are detokenized incrementally, stop strings end the choice
here and the engine is told to stop that sequence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagectl.admin.engine_client import EngineError
from pagectl.admin.validation import GenerationSpec, Prompt
from pagectl.engine.outputs import EngineCoreOutput, EngineRequest, TokenLogprobs
from pagectl.engine.tokenizer import IncrementalDetokenizer


class EngineRequestError(EngineError):
    """A sequence finished with "error" inside the engine (e.g. it cannot fit the KV pool)."""


@dataclass
class PromptRun:
    """One engine request: one prompt and its n samples."""

    request_id: str
    # Position among the request's prompts.
    pos: int
    prompt: Prompt
    num_cached_tokens: int = 0
    # Logprobs of prompt tokens 1.. (the first prompt token has none), when asked for.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_finished: int = 0


@dataclass
class Choice:
    index: int
    run: PromptRun
    # Index of this sample among its prompt's n (the engine's ``index``).
    sample: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Update:
    """What one engine output changed for one choice."""

    choice: Choice
    text: str
    # The engine output's new tokens and their logprobs (its own lists: read, never changed).
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    # True on the choice's last update (its finish_reason is set).
    finished: bool


class Generation:
    """Submits a validated request to the engine and turns its outputs into choice updates.

    Args:
        engine: an ``EngineClient`` (or anything with submit / abort / release /
            finish_stop_string).
        tokenizer: the HF tokenizer, or None.
        spec: the validated request.
        request_id: the HTTP request's id; engine requests are ``request_id`` (one prompt)
            or ``f"{request_id}-{p}"``.
        metrics: a ``Metrics`` (or None) to record latencies and finish reasons in.
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        spec: GenerationSpec,
        request_id: str,
        metrics: Any = None,
    ) -> None:
        self.engine = engine
        self.spec = spec
        self.request_id = request_id
        self.metrics = metrics
        self.queue: asyncio.Queue = asyncio.Queue()
        self.created = int(time.time())
        self.arrival = time.time()
        self._start = time.monotonic()
        self._first_token_seen = False
        n = spec.params.n
        single = len(spec.prompts) == 1
        self.runs = [
            PromptRun(request_id if single else f"{request_id}-{p}", p, prompt)
            for p, prompt in enumerate(spec.prompts)
        ]
        self._runs_by_id = {r.request_id: r for r in self.runs}
        self.choices = [
            Choice(
                p * n + i,
                run,
                i,
                IncrementalDetokenizer(tokenizer, run.prompt.token_ids, spec.params),
            )
            for p, run in enumerate(self.runs)
            for i in range(n)
        ]
        self.num_unfinished = len(self.choices)
        self._submitted: list[str] = []

    def submit(self) -> None:
        """Send every prompt to the engine (raises ``EngineDeadError`` if it is gone)."""
        sp = dataclasses.asdict(self.spec.params)
        beam = dataclasses.asdict(self.spec.beam) if self.spec.beam is not None else None
        for run in self.runs:
            self.engine.submit(
                EngineRequest(
                    request_id=run.request_id,
                    prompt_token_ids=run.prompt.token_ids,
                    sampling_params=sp,
                    priority=self.spec.priority,
                    cache_salt=self.spec.cache_salt,
                    arrival_time=self.arrival,
                    beam_search=beam,
                ),
                self.queue,
            )
            self._submitted.append(run.request_id)

    async def updates(self) -> AsyncIterator[Update]:
        """Choice updates until every choice has finished. Raises ``EngineError``."""
        while self.num_unfinished:
            item = await self.queue.get()
            if isinstance(item, EngineError):
                raise item
            upd = self._apply(item)
            if upd is not None:
                yield upd

    async def run_to_end(self) -> None:
        async for _ in self.updates():
            pass

    def _apply(self, out: EngineCoreOutput) -> Update | None:
        run = self._runs_by_id.get(out.request_id)
        if run is None:
            return None
        run.num_cached_tokens = max(run.num_cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs:
            run.prompt_logprobs.extend(out.prompt_logprobs)
        choice = self.choices[run.pos * self.spec.params.n + out.index]
        if choice.finished:
            return None  # outputs in flight after a stop string ended the choice here
        new = out.new_token_ids
        lps = out.new_logprobs or []
        text = ""
        if new:
            now = time.monotonic()
            if self.metrics is not None:
                if not self._first_token_seen:
                    self.metrics.ttft.observe(now - self._start)
                elif choice.last_token_time is not None:
                    self.metrics.itl.observe(now - choice.last_token_time)
            self._first_token_seen = True
            choice.last_token_time = now
            # A speculative run stops at the token that completes a stop string.
            text, num = choice.detok.push_run(new)
            new, lps = new[:num], lps[:num]
            choice.token_ids.extend(new)
            choice.logprobs.extend(lps)
        stop = choice.detok.stop_hit
        if stop is not None:
            self._finish(choice, "stop", stop)
            if out.finish_reason is None:
                self.engine.finish_stop_string(run.request_id, choice.sample, stop)
        elif out.finish_reason is not None:
            if out.finish_reason == "error":
                raise EngineRequestError(out.error or "the request failed in the engine")
            text += choice.detok.flush()
            self._finish(choice, out.finish_reason, out.stop_reason)
        elif not new:
            return None
        return Update(choice, text, new, lps, choice.finished)

    def _finish(self, choice: Choice, reason: str, stop_reason: int | str | None) -> None:
        choice.finish_reason = reason
        choice.stop_reason = stop_reason
        choice.run.num_finished += 1
        self.num_unfinished -= 1
        if self.metrics is not None:
            self.metrics.request_success.labels(reason).inc()
            if not self.num_unfinished:
                self.metrics.e2e.observe(time.monotonic() - self._start)

    def close(self) -> None:
        """Abort whatever is still running in the engine; stop routing outputs here."""
        n = self.spec.params.n
        unfinished = [r.request_id for r in self.runs if r.num_finished < n]
        if unfinished:
            self.engine.abort([rid for rid in unfinished if rid in self._submitted])
            if self.metrics is not None:
                for c in self.choices:
                    if not c.finished:
                        self.metrics.request_success.labels("abort").inc()
        self.engine.release(self._submitted)

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(r.prompt.token_ids) for r in self.runs)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.num_cached_tokens for r in self.runs)},
        }
