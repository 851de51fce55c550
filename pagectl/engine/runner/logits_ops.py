"""Row-wise operations on a batch of logits: the top-k / top-p and min-p cuts, and logprobs.

Pure functions over ``[rows, vocab]`` tensors, used by the ``Sampler`` (which decides which
rows get what) and by prompt-logprob scoring in the model runner.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagectl.engine.outputs import TokenLogprobs

# Most elements of one log-softmax block in compute_prompt_logprobs (float32: 128 MiB).
_PROMPT_BLOCK_ELEMS = 1 << 25
# Top-p looks for the nucleus among this many most likely tokens, then among more for rows
# whose nucleus did not fit, and sorts the whole row only as the last resort (a full sort
# costs about ten top-1024 searches on CPU).
_TOP_P_CANDIDATES = (1024, 8192)
_NEG_INF = float("-inf")


def apply_top_k_top_p(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> None:
    """Set to -inf, in place, every logit outside its row's top-k and then top-p set.

    Args:
        logits: ``[rows, vocab]`` float logits (temperature already applied).
        top_k: Per row; ``<= 0`` or ``>= vocab`` disables it.
        top_p: Per row; ``>= 1`` disables it. Keeps the smallest run of most likely tokens
            whose probability, renormalised over what top-k kept, reaches top_p (a token stays
            when the mass before it in descending order is below top_p, so the most likely
            token always stays).

    Both cuts become a per-row threshold: logits tied with the last kept one are kept too.
    """
    num_rows, vocab = logits.shape
    device = logits.device
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    p_rows = [i for i in range(num_rows) if top_p[i] < 1.0]
    k_rows = [i for i in range(num_rows) if ks[i] < vocab and top_p[i] >= 1.0]
    if not p_rows and not k_rows:
        return
    # Rows without a cut keep a -inf threshold: one masked_fill pass leaves them alone.
    threshold = torch.full((num_rows, 1), _NEG_INF, dtype=logits.dtype, device=device)
    if k_rows:
        k_index = torch.tensor(k_rows, device=device)
        k_sub = torch.tensor([ks[i] for i in k_rows], device=device)[:, None]
        top = logits.index_select(0, k_index).topk(max(ks[i] for i in k_rows), dim=-1)
        threshold.index_copy_(0, k_index, top.values.gather(1, k_sub - 1))
    if p_rows:
        p_index = torch.tensor(p_rows, device=device)
        sub = logits.index_select(0, p_index)
        k_sub = torch.tensor([ks[i] for i in p_rows], device=device)[:, None]
        p_sub = torch.tensor([top_p[i] for i in p_rows], dtype=torch.float64, device=device)
        p_sub = p_sub[:, None]
        cut = torch.empty((len(p_rows), 1), dtype=logits.dtype, device=device)
        pending = torch.arange(len(p_rows), device=device)
        for width in (*_TOP_P_CANDIDATES, vocab):
            # Every pending row gets this width's answer; rows not resolved retry wider.
            part, resolved = _nucleus_threshold(sub[pending], k_sub[pending], p_sub[pending], width)
            cut.index_copy_(0, pending, part)
            pending = pending[~resolved[:, 0]]
            if width >= vocab or not pending.numel():
                break
        threshold.index_copy_(0, p_index, cut)
    logits.masked_fill_(logits < threshold, _NEG_INF)


def _nucleus_threshold(
    logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the smallest logit kept by top-k then top-p, looking at ``width`` candidates.

    Returns ``(threshold [rows, 1], resolved [rows, 1])``. A row is resolved when its answer
    is exact: top-k fits among the candidates, or top-k is off and the nucleus ends before
    the last candidate.
    """
    width = min(width, logits.shape[1])
    cand = logits.topk(width, dim=-1).values  # descending
    positions = torch.arange(width, device=logits.device)
    cand = cand.masked_fill(positions >= k, _NEG_INF)
    # Normaliser of the distribution top-k left: over the candidates when they hold all of
    # top-k, else over the whole row, which is right only when top-k is disabled (k == vocab);
    # rows with width < k < vocab are never resolved here.
    lse = torch.where(
        k <= width, cand.logsumexp(dim=-1, keepdim=True), logits.logsumexp(dim=-1, keepdim=True)
    )
    probs = (cand - lse).exp().double()
    # Exclusive prefix mass: shifted cumsum, so it is non-decreasing and starts at exactly 0.
    cum = probs.cumsum(dim=-1)
    mass_before = torch.nn.functional.pad(cum[:, :-1], (1, 0))
    num_kept = torch.minimum((mass_before < p).sum(dim=-1, keepdim=True), k.clamp(max=width))
    resolved = (k <= width) | ((k == logits.shape[1]) & (num_kept < width))
    return cand.gather(1, num_kept - 1), resolved


def apply_min_p(logits: torch.Tensor, min_p: Sequence[float]) -> None:
    """Set to -inf, in place, logits whose probability is below ``min_p`` times their row's
    highest probability (compared in log space: ``x - max(x) < log(min_p)``)."""
    if not any(m > 0.0 for m in min_p):
        return
    log_min_p = torch.tensor(min_p, dtype=logits.dtype, device=logits.device).log_()[:, None]
    # log(0) = -inf: rows with min_p == 0 keep everything.
    gap = logits - logits.max(dim=-1, keepdim=True).values
    logits.masked_fill_(gap < log_min_p, _NEG_INF)


def token_logprobs(
    logprobs: torch.Tensor, targets: torch.Tensor, nums: Sequence[int]
) -> list[TokenLogprobs]:
    """Per row: the target's logprob, its rank (1 + ids strictly more likely), top nums[i]."""
    target_lp = logprobs.gather(1, targets[:, None].long())
    ranks = (logprobs > target_lp).sum(dim=-1).add_(1)
    most = max(nums, default=0)
    top_values: list[list[float]] = [[] for _ in nums]
    top_ids: list[list[int]] = [[] for _ in nums]
    if most:
        top = logprobs.topk(most, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    return [
        TokenLogprobs(lp, rank, list(zip(ids[:n], values[:n], strict=True)))
        for lp, rank, ids, values, n in zip(
            target_lp[:, 0].tolist(), ranks.tolist(), top_ids, top_values, nums, strict=True
        )
    ]


def compute_prompt_logprobs(
    logits: torch.Tensor,
    target_token_ids: torch.Tensor,
    num_logprobs: int,
    vocab_size: int | None = None,
) -> list[TokenLogprobs]:
    """Logprobs of the tokens that actually follow P positions, from their raw logits.

    Args:
        logits: ``[P, >= vocab]`` logits of P positions.
        target_token_ids: ``[P]`` the token that follows each position.
        num_logprobs: How many top (token id, logprob) pairs to return per position.
        vocab_size: When given, only the first vocab_size columns are used (padded LM heads).

    Returns:
        One ``TokenLogprobs`` per position, in order.
    """
    x = logits if vocab_size is None else logits[:, :vocab_size]
    targets = target_token_ids.to(device=x.device, dtype=torch.long)
    # Blocks of positions bound the float32 log-softmax copy for long prompts.
    block = max(1, _PROMPT_BLOCK_ELEMS // max(1, x.shape[1]))
    result: list[TokenLogprobs] = []
    for start in range(0, x.shape[0], block):
        logprobs = torch.log_softmax(x[start : start + block].float(), dim=-1)
        chunk_targets = targets[start : start + block]
        result.extend(token_logprobs(logprobs, chunk_targets, [num_logprobs] * len(logprobs)))
    return result
