"""One HTTP generation request in flight: its engine requests, its choices, their text.

A request with P prompts and n samples is P engine requests; choice ``p * n + i`` is sample
``i`` of prompt ``p`` (OpenAI's numbering). Outputs arrive on one queue in engine order; each
goes through the engine's ``OutputProcessor`` (text, stop strings, finish reasons, cached
tokens: the same rules as the offline ``LLM``); a stop string found there ends the choice
here and the engine is told to stop that sequence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagectl.engine.output_processor import OutputProcessor, RequestState, SampleState
from pagectl.engine.outputs import EngineCoreOutput, EngineRequest, TokenLogprobs
from pagectl.engine.tokenizer import IncrementalDetokenizer
from pagectl.engine_process.client import EngineClientProtocol, EngineError, OutputQueue
from pagectl.server.metrics import Metrics
from pagectl.server.validation import GenerationSpec, Prompt


class EngineRequestError(EngineError):
    """A sequence finished with "error" inside the engine (e.g. it cannot fit the KV pool)."""


@dataclass
class PromptRun:
    """One engine request: one prompt and its n samples."""

    # Position among the request's prompts.
    pos: int
    prompt: Prompt
    # The output processor's state of this engine request.
    state: RequestState

    @property
    def request_id(self) -> str:
        return self.state.request_id

    @property
    def num_cached_tokens(self) -> int:
        return self.state.num_cached_tokens

    @property
    def prompt_logprobs(self) -> list[TokenLogprobs]:
        """Logprobs of prompt tokens 1.. (the first prompt token has none), when asked for."""
        return self.state.prompt_logprobs


@dataclass
class Choice:
    index: int
    run: PromptRun
    # The output processor's state of this sample.
    seq: SampleState
    last_token_time: float | None = None

    @property
    def sample(self) -> int:
        """Index of this sample among its prompt's n (the engine's ``index``)."""
        return self.seq.index

    @property
    def detok(self) -> IncrementalDetokenizer:
        return self.seq.detok

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids

    @property
    def logprobs(self) -> list[TokenLogprobs]:
        return self.seq.logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.seq.finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.seq.stop_reason

    @property
    def finished(self) -> bool:
        return self.seq.finished

    @property
    def done(self) -> bool:
        """Ended normally (an "error" end is answered as an error, never as a choice)."""
        return self.seq.finished and self.seq.finish_reason != "error"


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
        engine: the engine client.
        tokenizer: the HF tokenizer, or None.
        spec: the validated request.
        request_id: the HTTP request's id; engine requests are ``request_id`` (one prompt)
            or ``f"{request_id}-{p}"``.
        metrics: where to record latencies and finish reasons, or None.
    """

    def __init__(
        self,
        engine: EngineClientProtocol,
        tokenizer: Any,
        spec: GenerationSpec,
        request_id: str,
        metrics: Metrics | None = None,
    ) -> None:
        self.engine = engine
        self.spec = spec
        self.request_id = request_id
        self.metrics = metrics
        self.queue: OutputQueue = asyncio.Queue()
        self.created = int(time.time())
        self.arrival = time.time()
        self._start = time.monotonic()
        self._first_token_seen = False
        n = spec.params.n
        single = len(spec.prompts) == 1
        self.processor = OutputProcessor(tokenizer)
        self.runs = [
            PromptRun(
                p,
                prompt,
                self.processor.add_request(
                    request_id if single else f"{request_id}-{p}", prompt.token_ids, spec.params
                ),
            )
            for p, prompt in enumerate(spec.prompts)
        ]
        self._runs_by_id = {r.request_id: r for r in self.runs}
        self.choices = [
            Choice(p * n + i, run, run.state.samples[i])
            for p, run in enumerate(self.runs)
            for i in range(n)
        ]
        self.num_unfinished = len(self.choices)
        self._submitted: list[str] = []

    def submit(self) -> None:
        """Send every prompt to the engine (raises ``EngineDeadError`` if it is gone)."""
        sp = dataclasses.asdict(self.spec.params)
        for run in self.runs:
            self.engine.submit(
                EngineRequest(
                    request_id=run.request_id,
                    prompt_token_ids=run.prompt.token_ids,
                    sampling_params=sp,
                    priority=self.spec.priority,
                    cache_salt=self.spec.cache_salt,
                    arrival_time=self.arrival,
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
        su = self.processor.process(out)
        if su is None:
            return None
        run = self._runs_by_id[su.request.request_id]
        choice = self.choices[run.pos * self.spec.params.n + su.sample.index]
        if su.token_ids:
            now = time.monotonic()
            if self.metrics is not None:
                if not self._first_token_seen:
                    self.metrics.ttft.observe(now - self._start)
                elif choice.last_token_time is not None:
                    self.metrics.itl.observe(now - choice.last_token_time)
            self._first_token_seen = True
            choice.last_token_time = now
        if su.stop_in_engine is not None:
            self.engine.finish_stop_string(run.request_id, choice.sample, su.stop_in_engine)
        if su.finished:
            if choice.finish_reason == "error":
                raise EngineRequestError(su.sample.error or "the request failed in the engine")
            self._finished(choice)
        return Update(choice, su.text, su.token_ids, su.logprobs, su.finished)

    def _finished(self, choice: Choice) -> None:
        self.num_unfinished -= 1
        if self.metrics is not None:
            self.metrics.request_success.labels(choice.finish_reason).inc()
            if not self.num_unfinished:
                self.metrics.e2e.observe(time.monotonic() - self._start)

    def close(self) -> None:
        """Abort whatever is still running in the engine; stop routing outputs here."""
        unfinished = [r.request_id for r in self.runs if not all(c.done for c in self._of(r))]
        if unfinished:
            self.engine.abort([rid for rid in unfinished if rid in self._submitted])
            if self.metrics is not None:
                for c in self.choices:
                    if not c.done:
                        self.metrics.request_success.labels("abort").inc()
        self.engine.release(self._submitted)

    def _of(self, run: PromptRun) -> list[Choice]:
        n = self.spec.params.n
        return self.choices[run.pos * n : (run.pos + 1) * n]

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(r.prompt.token_ids) for r in self.runs)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.num_cached_tokens for r in self.runs)},
        }
