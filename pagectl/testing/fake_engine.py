"""A deterministic fake model behind a real ``EngineCore``, for tests without torch.

``fake_engine`` is an engine factory (``--engine-factory pagectl.testing.fake_engine:fake_engine``)
for fault injection. Environment knobs: ``PAGECTL_FAKE_STEP_DELAY_S`` (sleep per step),
``PAGECTL_FAKE_CRASH_AFTER_STEPS``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from pagectl.engine.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs


class FakeExecutor:
    """Deterministic 'model': the next token depends on the last tokens and the sample index.

    Tokens are drawn from [3, vocab_size) so special tokens (0-2 in the tiny tokenizer) are
    never produced. Logprobs are fixed fake values when asked for.
    """

    def __init__(self, vocab_size: int, step_delay_s: float = 0.0, crash_after_steps: int = 0):
        self.vocab_size = vocab_size
        self.step_delay_s = step_delay_s
        self.crash_after_steps = crash_after_steps
        self.steps = 0

    def next_token(self, req: Any) -> int:
        toks = req.all_token_ids
        return (sum(toks[-3:]) * 31 + len(toks) * 7 + req.index * 13) % (self.vocab_size - 3) + 3

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps += 1
        if self.crash_after_steps and self.steps >= self.crash_after_steps:
            raise RuntimeError(f"injected failure at step {self.steps}")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        sampled = []
        lps: list[TokenLogprobs | None] = []
        for req, sample in zip(so.seqs, so.sample, strict=False):
            tok = self.next_token(req) if sample else -1
            sampled.append(tok)
            k = req.sampling_params.logprobs
            if sample and k is not None:
                top = [(tok, -0.25)] + [
                    ((tok + j) % self.vocab_size, -1.0 - j) for j in range(1, k)
                ]
                lps.append(TokenLogprobs(-0.25, 1, top[:k]))
            else:
                lps.append(None)
        return ModelRunnerOutput(sampled, lps if any(lp is not None for lp in lps) else None)


@dataclass
class FakeBuiltEngine:
    """Same fields as ``pagectl.engine.builder.BuiltEngine``."""

    core: Any
    tokenizer: Any
    model_name: str
    model_path: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    def shutdown(self) -> None:
        pass


def fake_engine(args: Any) -> FakeBuiltEngine:
    """Engine factory: a real Scheduler + EngineCore over ``FakeExecutor``.

    ``args.model`` may be a directory holding a Hugging Face tokenizer (its vocabulary size
    is used); otherwise the vocabulary is 384 tokens and there is no tokenizer.
    """
    from pagectl.engine.config import CacheConfig, SchedulerConfig
    from pagectl.engine.core import EngineCore
    from pagectl.engine.scheduler import Scheduler
    from pagectl.engine.telemetry import ModelInfo
    from pagectl.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model) if args.model else None
    vocab = len(tokenizer) if tokenizer is not None else 384
    max_len = args.max_model_len or 256
    budget = args.token_budget("cpu")
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=args.max_num_seqs,
            max_model_len=max_len,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            policy=args.scheduling_policy,
        ),
        CacheConfig(args.block_size, args.num_kv_blocks or 256, args.enable_prefix_caching),
    )
    name = args.served_model_name or "fake-model"
    executor = FakeExecutor(
        vocab,
        float(os.environ.get("PAGECTL_FAKE_STEP_DELAY_S", "0") or 0),
        int(os.environ.get("PAGECTL_FAKE_CRASH_AFTER_STEPS", "0") or 0),
    )
    core = EngineCore(
        sched,
        executor,
        vocab_size=vocab,
        eos_token_ids=(0,),
        model_info=ModelInfo(model=name, dtype="float32", device="cpu", max_model_len=max_len),
        tokenizer_decode=tokenizer.decode if tokenizer is not None else None,
    )
    return FakeBuiltEngine(core, tokenizer, name, str(args.model or ""), vocab, max_len, [0])
