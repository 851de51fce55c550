"""Rejection sampling of a sampled draft's proposals (the draft-model method).

Row j of a sequence with proposals d_1..d_k is the target's distribution p_j of the token
after its tokens and d_1..d_j (the sampler's processed distribution: penalties, top-k/p,
min-p, temperature; one-hot for greedy sequences). Proposal d_{j+1} was drawn from the
draft's distribution q_{j+1}. Row j then emits d_{j+1} with probability
min(1, p_j(d_{j+1}) / q_{j+1}(d_{j+1})), else a draw from the residual
norm(max(0, p_j - q_{j+1})); the row after the last proposal (and every row with no proposal
to check) draws from p. The first row that does not emit its proposal ends the accepted run
(``verify.num_accepted``). Each emitted token then has exactly the target's distribution.

With greedy sequences p and q are one-hot, so a proposal is kept exactly when it is the
target's argmax and a rejected row emits that argmax: plain greedy decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagectl.engine.runner.sampler import Sampler, SamplerResult


def rejection_sample(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: Sequence[Any],
    draft_rows: list[int],
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
) -> SamplerResult:
    """One token per row of ``logits`` (the target's), as the module docstring says.

    ``draft_rows[t]`` is a row that checks proposal ``draft_tokens[t]``, drawn from
    ``draft_probs[t]`` (``[len(draft_rows), sampler.vocab_size]``).
    """
    p = sampler.sampling_probs(logits, rows)
    if not draft_rows:
        tokens = sampler.draw_from(p, rows)
    else:
        assert draft_probs is not None
        dev = p.device
        checks = set(draft_rows)
        fresh = [r for r in range(len(rows)) if r not in checks]
        tokens = torch.empty(len(rows), dtype=torch.long, device=dev)
        # Only the rows without a proposal are drawn from p (a checking row's draw was never
        # used), yet the random numbers of every row are still generated, in this order:
        # draws from p, uniforms, residual draws. Generating fewer would shift every later
        # number of a seeded sequence's stream (and the engine's): the same seed would give
        # other tokens than it gave. What is saved is turning them into tokens (the float64
        # cumulative sum of the inverse CDF; the race's division and argmax).
        fresh_tokens = sampler.draw_from(p, rows, rows_to_draw=fresh)
        tokens.index_copy_(0, torch.tensor(fresh, dtype=torch.long, device=dev), fresh_tokens)
        index, checked_tokens = check_proposals(
            sampler, p, rows, draft_rows, draft_tokens, draft_probs
        )
        tokens.index_copy_(0, index, checked_tokens)
    return SamplerResult(tokens.tolist(), sampler.logprobs_of(logits, tokens, rows))


def check_proposals(
    sampler: Sampler,
    p: torch.Tensor,
    rows: Sequence[Any],
    draft_rows: list[int],
    draft_tokens: list[int],
    draft_probs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token of each row that checks a proposal: the proposal if accepted, else a draw
    from the residual. Returns (the rows' indices, their tokens); draws the uniforms, then
    the residual draws, in that order."""
    dev = p.device
    index = torch.tensor(draft_rows, dtype=torch.long, device=dev)
    d = torch.tensor(draft_tokens, dtype=torch.long, device=dev)
    pr = p.index_select(0, index)
    q = draft_probs.to(pr.dtype)
    p_d = pr.gather(1, d[:, None])[:, 0].double()
    q_d = q.gather(1, d[:, None])[:, 0].double()
    checked = [rows[r] for r in draft_rows]
    # P(u * q < p) = min(1, p / q) for u uniform in [0, 1); q(d) > 0 as d was drawn
    # from q, and p(d) == 0 never accepts.
    accept = sampler.uniform(checked) * q_d < p_d
    residual = (pr - q).clamp_(min=0.0)
    # An all-zero residual means p == q there, which accepts with probability 1; p keeps
    # the draw well defined.
    empty = residual.sum(dim=-1) <= 0
    if bool(empty.any()):
        residual[empty] = pr[empty]
    return index, torch.where(accept, d, sampler.draw_from(residual, checked))
