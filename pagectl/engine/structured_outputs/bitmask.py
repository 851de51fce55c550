"""The sampler's structured-outputs step: each constrained row's token bitmask on its logits.

Runs only when a batch has constrained rows; the bitmask has a row per batch row (xgrammar
indexes it by the logits row) but only the constrained rows are filled and applied. A
speculated sequence's verification rows come in order, each filled with the matcher
advanced through the proposals before it; every matcher is rolled back to its sequence's
own tokens before this returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def apply_grammar_bitmask(
    logits: torch.Tensor, seqs: Sequence[Any], rows: list[int], vocab_size: int
) -> None:
    """Set to -inf, in place, every token the grammar of ``seqs[i]`` forbids, for i in
    ``rows``. ``logits`` is float32 ``[len(seqs), vocab_size]``."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab_size)
    try:
        for i in rows:
            seqs[i].grammar.fill(bitmask, i)
    finally:
        for i in rows:
            seqs[i].grammar.settle()
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)
