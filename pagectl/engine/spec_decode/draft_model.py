"""The draft-model proposer: a smaller model with the target's tokenizer proposes up to K
tokens per speculating sequence, one batched forward per proposal position.

Runs on tensor-parallel rank 0 only, unsharded, inside rank 0's ``ModelRunner`` (the other
ranks never see it: they receive the verification step as any other step).

The draft's KV cache is its own paged pool with the target's block count and block size,
indexed by the target's block tables: allocation, prefix caching, copy-on-write copies and
freeing are the scheduler's, once, for both models. Invariant: wherever the target's KV is
valid (a sequence's computed positions; every block in the prefix cache) the draft's is too.
It holds because the draft is fed every position the target is fed, in the same step:

1. pass 1 (every step): the step's rows as the target runs them (prompt chunks, decodes,
   recomputes after preemption), except that a speculating sequence feeds only its last
   token x, at its ``num_computed_tokens`` nc; the logits there give proposal 1;
2. pass j = 2..K: proposal j-1 at nc + j - 1, for the sequences with at least j proposals;
3. after verification, only for sequences that accepted all their k proposals: proposal k
   at nc + k (no logits), as the target now counts that position computed.

So a block the prefix cache serves, or that a fork shares, holds the draft's KV as it holds
the target's. Positions fed with proposals that were rejected hold stale KV in both pools
and are written again when the sequence reaches them.

Proposals are drawn from the draft's own distribution q: the sampler's processed
distribution of the draft's logits under the sequence's params (greedy: the argmax). q goes
to the verification (``rejection.py``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from pagectl.engine.outputs import ModelRunnerOutput, SchedulerOutput
from pagectl.engine.runner.input_batch import OneToken
from pagectl.engine.runner.sampler import Sampler, SamplerResult
from pagectl.engine.spec_decode.rejection import rejection_sample
from pagectl.engine.spec_decode.verify import SpecRow

if TYPE_CHECKING:
    from pagectl.engine.runner.input_batch import SamplingPlan
    from pagectl.engine.runner.model_runner import ModelRunner


class _NoPromptLogprobs:
    """The sampling params the batch builder reads from a draft row: no prompt scoring."""

    __slots__ = ()
    prompt_logprobs = None


_NO_PROMPT_LOGPROBS = _NoPromptLogprobs()


class _DraftSeq:
    """A sequence as the draft's batch builder sees it: feed from ``num_computed_tokens``
    over the sequence's own block table."""

    __slots__ = ("all_token_ids", "num_computed_tokens", "block_ids", "seq_id", "sampling_params")

    def __init__(self, req: Any, num_computed: int, tokens: Any) -> None:
        self.all_token_ids = tokens
        self.num_computed_tokens = num_computed
        self.block_ids = req.block_ids
        self.seq_id = req.seq_id
        self.sampling_params = _NO_PROMPT_LOGPROBS


class DraftModelProposer:
    """Owns the draft model's runner (its KV pool, attention backend and batch builder) and
    a sampler of its own, over the target's vocabulary."""

    def __init__(self, runner: ModelRunner, vocab_size: int, seed: int) -> None:
        self.runner = runner
        # The draft's runner only runs forwards (``run_arrays``; built with
        # ``samples=False``): this proposer samples, over the target's vocabulary and its
        # own stream.
        self.vocab_size = vocab_size
        # Its own random streams: the target's verification draws must not repeat the
        # numbers the proposals were drawn with.
        self.sampler = Sampler(vocab_size, device=runner.device, seed=seed + 1, stream=1)
        # This step's draft distributions: scheduler index -> [k, vocab_size] (rows of the
        # proposals in order); empty when every speculating sequence is greedy. Set by
        # ``propose``, read by ``verify`` of the same step.
        self._probs: dict[int, torch.Tensor] = {}

    def release(self) -> None:
        self.runner.release()

    # -- the step ---------------------------------------------------------------------------
    # ``propose``, then the target's forward, ``verify`` (its sampling), then ``finish``.

    def propose(self, so: SchedulerOutput) -> SchedulerOutput:
        """Run passes 1..K for ``so`` (its proposals are placeholders, ``slots.py``) and
        return it with the draft's proposals in their place."""
        if so.finished_seq_ids:
            self.sampler.forget(so.finished_seq_ids)
        self._probs = {}
        spec = so.spec_token_ids
        if not so.seqs:
            self.runner.kv.copy_blocks(so.block_copies)
            return so
        views = []
        counts = []
        sample = []
        for i, (req, n) in enumerate(zip(so.seqs, so.num_scheduled_tokens, strict=True)):
            k = len(spec[i]) if spec else 0
            views.append(_DraftSeq(req, req.num_computed_tokens, req.all_token_ids))
            counts.append(1 if k else n)
            sample.append(k > 0)
        logits, picked = self._forward(views, counts, sample, so.block_copies)
        if not spec:
            return so
        drafts: dict[int, list[int]] = {i: [] for i, s in enumerate(spec) if s}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in drafts}
        # Greedy sequences propose the argmax (q one-hot: no distribution to keep).
        greedy = all(so.seqs[i].sampling_params.greedy for i in drafts)
        kmax = max(len(spec[i]) for i in drafts)
        for j in range(kmax):
            if j:
                active = [i for i in drafts if len(spec[i]) > j]
                views = [
                    _DraftSeq(
                        so.seqs[i],
                        so.seqs[i].num_computed_tokens + j,
                        OneToken(so.seqs[i].num_computed_tokens + j, drafts[i][-1]),
                    )
                    for i in active
                ]
                logits, order = self._forward(views, [1] * len(views), [True] * len(views), [])
                picked = [active[t] for t in order]
            assert logits is not None
            rows: list[Any] = [SpecRow(so.seqs[i], list(drafts[i])) for i in picked]
            if greedy:
                # The sampler's greedy choice (the argmax of the processed logits, of the raw
                # ones for rows that have no processing), without the logprobs the rows may
                # ask for: a proposal's are never reported.
                tokens = self.sampler.greedy_tokens(self._vocab(logits), rows).tolist()
            else:
                q = self.sampler.sampling_probs(self._vocab(logits), rows)
                tokens = self.sampler.draw_from(q, rows).tolist()
                for t, i in enumerate(picked):
                    probs[i].append(q[t])
            for t, i in enumerate(picked):
                drafts[i].append(tokens[t])
        if not greedy:
            self._probs = {i: torch.stack(p) for i, p in probs.items()}
        return dataclasses.replace(
            so, spec_token_ids=[drafts.get(i, []) for i in range(len(so.seqs))]
        )

    def verify(
        self,
        sampler: Sampler,
        logits: torch.Tensor,
        rows: list[Any],
        plan: SamplingPlan,
        so: SchedulerOutput,
    ) -> SamplerResult:
        """The target's tokens for the sampling rows of a speculative step (``rows`` as
        ``ModelRunner._sample_spec`` lays them out), by rejection sampling against the
        draft distributions of this step's ``propose``. When every proposal was greedy
        (q one-hot), that rule is: keep a proposal while it is the target's own sample."""
        if not self._probs:
            return sampler(logits, rows)
        draft_rows: list[int] = []
        draft_tokens: list[int] = []
        draft_probs: list[torch.Tensor] = []
        r = 0
        for i, c in zip(plan.sample_indices, plan.num_sample_rows, strict=True):
            if c > 1:
                draft_rows.extend(range(r, r + c - 1))
                draft_tokens.extend(so.spec_token_ids[i])
                draft_probs.append(self._probs[i])
            r += c
        q = torch.cat(draft_probs) if draft_probs else None
        return rejection_sample(sampler, logits, rows, draft_rows, draft_tokens, q)

    def finish(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """Pass K + 1: the last proposal of each sequence that accepted all of its."""
        self._probs = {}
        gained = out.spec_output_token_ids
        if not so.spec_token_ids or gained is None:
            return
        views = []
        for i, drafts in enumerate(so.spec_token_ids):
            if drafts and len(gained[i]) == len(drafts) + 1:
                pos = so.seqs[i].num_computed_tokens + len(drafts)
                views.append(_DraftSeq(so.seqs[i], pos, OneToken(pos, drafts[-1])))
        if views:
            self._forward(views, [1] * len(views), [False] * len(views), [])

    # -- internals --------------------------------------------------------------------------

    def _forward(
        self, views: list, counts: list[int], sample: list[bool], copies: list[tuple[int, int]]
    ) -> tuple[torch.Tensor | None, list[int]]:
        """One draft forward; returns the logits of the sampling rows and which entries of
        ``views`` they belong to, in row order."""
        so = SchedulerOutput(
            step_id=0,
            seqs=views,
            num_scheduled_tokens=counts,
            sample=sample,
            total_num_scheduled_tokens=sum(counts),
        )
        arrays, plan = self.runner.batch_builder.plan(so, {})
        _, logits, _ = self.runner.run_arrays(arrays, copies)
        return logits, plan.sample_indices

    def _vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's vocabulary (columns it lacks at -inf)."""
        missing = self.vocab_size - logits.shape[1]
        if missing <= 0:
            return logits
        pad = logits.new_full((logits.shape[0], missing), float("-inf"))
        return torch.cat([logits, pad], dim=1)
