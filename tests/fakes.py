"""Test doubles for the engine: a model runner that needs no model."""

from __future__ import annotations

from collections.abc import Callable

from pagectl.engine.outputs import ModelRunnerOutput, SchedulerOutput
from pagectl.engine.request import Request


def default_next_token(req: Request) -> int:
    """A deterministic 'model': the next token depends on the sequence's tokens and index."""
    toks = req.all_token_ids
    return (sum(toks[-4:]) * 31 + len(toks) * 7 + req.index * 13) % 1000 + 10


class FakeRunner:
    """Samples with ``next_token(req)``; records every scheduler output it ran."""

    def __init__(self, next_token: Callable[[Request], int] = default_next_token) -> None:
        self.next_token = next_token
        self.steps: list[SchedulerOutput] = []
        self.copies: list[tuple[int, int]] = []

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(so)
        self.copies.extend(so.block_copies)
        return ModelRunnerOutput(
            [self.next_token(r) if s else -1 for r, s in zip(so.seqs, so.sample)]
        )
