"""Verification of proposed tokens against the target model's own samples.

A sequence with proposals d_1..d_k gets k + 1 logits rows in one forward: row j is the
distribution of the token after its tokens and d_1..d_j. Each row is sampled with the
sequence's own parameters as if d_1..d_j were already its tokens (``SpecRow``: penalties and
min_tokens see them), and the run is accepted while the sample equals the proposal.

For a deterministic proposal (n-gram; a greedy draft) this is the rejection rule
min(1, p/q) with q one-hot: the proposal is kept with probability p(d_j), and on rejection
the sample drawn from p is a draw from the residual (p with d_j removed, renormalised),
since it is conditioned on differing from d_j. So every emitted token has exactly the
target's distribution, and at temperature 0 the output is the plain greedy output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagectl.engine.request import Request


class SpecRow:
    """The sampler's view of a sequence at verification row j: its tokens and then its
    first j proposals (the attributes the sampler reads, nothing else)."""

    __slots__ = (
        "_req",
        "_extra",
        "sampling_params",
        "stop_ids",
        "min_num_tokens",
        "num_prompt_tokens",
        "seq_id",
        "index",
        "grammar",
    )

    def __init__(self, req: Request, extra: list[int]) -> None:
        self._req = req
        self._extra = extra
        self.sampling_params = req.sampling_params
        self.stop_ids = req.stop_ids
        self.min_num_tokens = req.min_num_tokens
        self.num_prompt_tokens = req.num_prompt_tokens
        # The same seq_id: a seeded sequence draws every row from its own generator.
        self.seq_id = req.seq_id
        self.index = req.index
        # A constrained sequence's row j: its grammar as if the j proposals were accepted.
        self.grammar = None if req.grammar is None else req.grammar.view_ahead(extra)

    @property
    def all_token_ids(self) -> list[int]:
        return self._req.all_token_ids + self._extra


def num_accepted(proposals: list[int], sampled: list[int]) -> int:
    """How many leading proposals equal the samples of their rows."""
    m = 0
    for d, t in zip(proposals, sampled):
        if d != t:
            break
        m += 1
    return m
