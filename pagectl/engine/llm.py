"""The offline Python API: ``LLM`` and its outputs.

    from pagectl import LLM, SamplingParams
    llm = LLM(model="path/or/hub-id", dtype="float32")
    outs = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=32, temperature=0))
    print(outs[0].outputs[0].text)

Runs the engine loop in the caller's thread: ``generate`` adds every prompt, steps the engine
until all are finished, and returns one ``RequestOutput`` per prompt, in input order.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagectl.engine.args import EngineArgs
from pagectl.engine.output_processor import OutputProcessor
from pagectl.engine.outputs import TokenLogprobs
from pagectl.engine.sampling_params import SamplingParams
from pagectl.engine.tokenizer import apply_chat_template

PromptType = str | dict | list[int]


@dataclass
class CompletionOutput:
    """One of the n samples of a request."""

    index: int
    text: str
    token_ids: list[int]
    # "stop", "length", "abort" or "error".
    finish_reason: str | None
    # The stop string or stop token id that ended it, if any.
    stop_reason: int | str | None = None
    # Per generated token, when SamplingParams.logprobs was set.
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(lp.logprob for lp in self.logprobs)


@dataclass
class RequestOutput:
    """The result for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # Prompt tokens served by the prefix cache.
    num_cached_tokens: int = 0
    # Per prompt token (None for the first), when SamplingParams.prompt_logprobs was set.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finished: bool = True


class LLM:
    """An engine in this process, for batch generation without a server."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """``LLM(model, **EngineArgs fields)``; every option and its default is in
        ``EngineArgs`` (pagectl/engine/args.py)."""
        self._start(EngineArgs(model=model, **kwargs))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm._start(args)
        return llm

    def _start(self, args: EngineArgs) -> None:
        from pagectl.engine.builder import build_engine

        self.args = args
        self.engine = build_engine(self.args)
        self.core = self.engine.core
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._closed = False
        # Shut workers down at interpreter exit even if the caller forgets.
        self._finalizer = weakref.finalize(self, _shutdown_engine, self.engine)
        atexit.register(self._finalizer)

    # -- public API ---------------------------------------------------------------------

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters ``generate`` and ``chat`` use when given none: the
        model's generation_config.json settings over the engine's defaults (with
        ``generation_config="none"``, the engine's defaults alone)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list of them.

        A prompt is a string, ``{"prompt": str}``, ``{"prompt_token_ids": [...]}`` or a list of
        token ids. ``sampling_params`` is one for all prompts or one per prompt; none means
        ``get_default_sampling_params()``.
        """
        plist = self._normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(plist)
        else:
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(
                    f"got {len(params)} sampling params for {len(plist)} prompts (give one, or one per prompt)"
                )
        encoded = [self._encode(p) for p in plist]
        return self._run(encoded, params, priority, cache_salt)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = [
            {
                "prompt_token_ids": apply_chat_template(
                    self.tokenizer, list(c), **(chat_template_kwargs or {})
                )
            }
            for c in convs
        ]
        return self.generate(prompts, sampling_params)

    def shutdown(self) -> None:
        """Stop the engine and any worker processes. Idempotent."""
        if not self._closed:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals ----------------------------------------------------------------------

    @staticmethod
    def _normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        items: list = list(prompts)
        if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            return [items]  # a single prompt given as token ids
        return items

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def _run(
        self,
        encoded: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        priority: Sequence[int] | None,
        cache_salt: str | None,
    ) -> list[RequestOutput]:
        if self._closed:
            raise RuntimeError("this LLM has been shut down")
        core = self.core
        rids = [f"llm-{next(self._ids)}" for _ in encoded]
        proc = OutputProcessor(self.tokenizer)
        added: list[str] = []
        try:
            for i, ((_, ids), sp) in enumerate(zip(encoded, params)):
                core.add_request(
                    rids[i],
                    ids,
                    sp,
                    priority=priority[i] if priority is not None else 0,
                    cache_salt=cache_salt,
                )
                added.append(rids[i])
                proc.add_request(rids[i], ids, sp)
            while core.has_unfinished():
                for o in core.step():
                    upd = proc.process(o)
                    if upd is not None and upd.stop_in_engine is not None:
                        core.finish_by_stop_string(o.request_id, o.index, upd.stop_in_engine)
        except BaseException:
            for rid in added:
                core.abort_request(rid)
            core.take_pending_outputs()
            raise
        results = []
        for rid, (prompt, ids), sp in zip(rids, encoded, params):
            req = proc.requests[rid]
            outs = [
                CompletionOutput(
                    s.index,
                    s.text,
                    s.token_ids,
                    s.finish_reason,
                    s.stop_reason,
                    s.logprobs if sp.logprobs is not None else None,
                    s.error,
                )
                for s in req.samples
            ]
            prompt_lps: list[TokenLogprobs | None] | None = None
            if sp.prompt_logprobs is not None:
                prompt_lps = [None, *req.prompt_logprobs]
            results.append(
                RequestOutput(
                    rid,
                    prompt,
                    ids,
                    outs,
                    num_cached_tokens=req.num_cached_tokens,
                    prompt_logprobs=prompt_lps,
                )
            )
        return results


def _shutdown_engine(engine: Any) -> None:
    with contextlib.suppress(Exception):  # best effort at interpreter exit
        engine.shutdown()
