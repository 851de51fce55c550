"""Batch preparation: one step's scheduled sequences -> packed model inputs.

Per sequence the work is O(1) Python (slicing its token and block lists); everything per
token (positions, slot mapping, block-table padding, logits rows) is numpy on whole arrays.

Batch order (the runner's, not the scheduler's): sequences feeding one token come first,
sorted by ascending length (the decode rows the attention backends batch), then the others
in scheduler order. ``StepBatch.order[r]`` is the scheduler index of batch sequence ``r``.

Two halves: ``plan`` turns a ``SchedulerOutput`` into ``StepArrays`` (host arrays: all a
forward needs) plus what only sampling needs; ``from_arrays`` turns ``StepArrays`` into device
tensors and ``AttentionMetadata``. Tensor-parallel rank 0 plans and broadcasts the arrays;
every rank, rank 0 included, then runs ``from_arrays`` on the same arrays, so all ranks run
the same forward.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from pagectl.engine.attention.metadata import AttentionMetadata
from pagectl.engine.outputs import SchedulerOutput


@dataclass
class PromptLogprobsPlan:
    # Scheduler index of the sequence, first logits row of its scored positions, and the
    # prompt tokens those positions predict (position p predicts token p + 1).
    seq_index: int
    row_start: int
    target_token_ids: list[int]
    num_logprobs: int


@dataclass
class StepArrays:
    """The host arrays (numpy int64) of one step that every tensor-parallel rank needs to run
    the forward; ``T`` rows, ``S`` sequences, ``R`` logits rows."""

    token_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    # Where each row's K/V are written: block * block_size + offset.
    slot_mapping: np.ndarray  # [T]
    # Row ranges per sequence, and sequence lengths after the step.
    query_start_loc: np.ndarray  # [S + 1]
    seq_lens: np.ndarray  # [S]
    # Each sequence's blocks, padded with the scratch block.
    block_tables: np.ndarray  # [S, max blocks]
    # Hidden rows to compute logits for (prompt-logprob rows, then one per sampling sequence,
    # k + 1 for a sequence verifying k proposals).
    logits_rows: np.ndarray  # [R]
    # Leading sequences that feed one token each.
    num_decodes: int
    # Dynamic NTK rope only: each row's sequence length after the step.
    token_seq_lens: np.ndarray | None = None


@dataclass
class SamplingPlan:
    """What only the planning rank (tensor-parallel rank 0) needs after the forward."""

    # Scheduler index of each batch sequence.
    order: list[int] = field(default_factory=list)
    # Scheduler indices of the sampling sequences, in logits-row order (after the prompt rows).
    sample_indices: list[int] = field(default_factory=list)
    num_prompt_logprob_rows: int = 0
    prompt_logprobs: list[PromptLogprobsPlan] = field(default_factory=list)
    # Speculative steps only (else empty): logits rows of each sampling sequence, parallel
    # to ``sample_indices`` (1, or k + 1 for a sequence with k proposals).
    num_sample_rows: list[int] = field(default_factory=list)


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    # Hidden rows to compute logits for: prompt-logprob rows first, then one row per sampling
    # sequence (int64 device tensor).
    logits_rows: torch.Tensor
    # Empty on tensor-parallel workers.
    sampling: SamplingPlan = field(default_factory=SamplingPlan)

    @property
    def order(self) -> list[int]:
        return self.sampling.order

    @property
    def sample_indices(self) -> list[int]:
        return self.sampling.sample_indices

    @property
    def prompt_logprobs(self) -> list[PromptLogprobsPlan]:
        return self.sampling.prompt_logprobs


class BatchBuilder:
    """Builds ``StepBatch`` objects; holds only configuration (no per-sequence state)."""

    def __init__(
        self,
        block_size: int,
        scratch_block: int,
        device: torch.device,
        dynamic_rope_len: int | None = None,
    ) -> None:
        self.block_size = block_size
        # Block id used to pad block tables (never owned by a sequence).
        self.scratch_block = scratch_block
        self.device = device
        # Dynamic NTK rope: past this sequence length, rows need their sequence's length.
        self.dynamic_rope_len = dynamic_rope_len

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def build(self, so: SchedulerOutput, prompt_scored: dict[str, int]) -> StepBatch:
        """Pack ``so`` into device tensors (``plan`` then ``from_arrays``)."""
        arrays, sampling = self.plan(so, prompt_scored)
        batch = self.from_arrays(arrays)
        batch.sampling = sampling
        return batch

    def plan(
        self, so: SchedulerOutput, prompt_scored: dict[str, int]
    ) -> tuple[StepArrays, SamplingPlan]:
        """Host arrays for ``so`` (at least one sequence). ``prompt_scored[seq_id]`` is how
        many leading prompt positions already had their logprobs returned (updated here for
        the positions scored this step)."""
        bs = self.block_size
        seqs: list = so.seqs
        counts = so.num_scheduled_tokens
        sample = so.sample
        spec = so.spec_token_ids
        # Scheduler index of each entry (entries are the scheduled sequences, except that a
        # speculating one becomes k + 1 one-token entries, see _expand_spec).
        owner: list[int] | None = None
        if spec:
            seqs, counts, sample, owner = _expand_spec(so)
        decodes = [i for i, n in enumerate(counts) if n == 1]
        decodes.sort(key=lambda i: seqs[i].num_computed_tokens)
        order = decodes + [i for i, n in enumerate(counts) if n != 1]
        num_seqs = len(order)

        starts = np.fromiter((seqs[i].num_computed_tokens for i in order), np.int64, num_seqs)
        q_lens = np.fromiter((counts[i] for i in order), np.int64, num_seqs)
        seq_lens = starts + q_lens
        cu = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(q_lens, out=cu[1:])
        num_tokens = int(cu[-1])

        token_ids = np.fromiter(
            itertools.chain.from_iterable(
                seqs[i].all_token_ids[s : s + n]
                for i, s, n in zip(order, starts.tolist(), q_lens.tolist(), strict=True)
            ),
            np.int64,
            num_tokens,
        )
        seq_of_row = np.repeat(np.arange(num_seqs), q_lens)
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - cu[:-1], q_lens)

        # Block tables: each sequence's blocks covering [0, seq_len), padded with scratch.
        nb = (seq_lens + bs - 1) // bs
        max_nb = int(nb.max())
        flat = np.fromiter(
            itertools.chain.from_iterable(
                seqs[i].block_ids[:k] for i, k in zip(order, nb.tolist(), strict=True)
            ),
            np.int64,
            int(nb.sum()),
        )
        tables = np.full((num_seqs, max_nb), self.scratch_block, np.int64)
        tables[np.arange(max_nb)[None, :] < nb[:, None]] = flat
        slots = tables[seq_of_row, positions // bs] * bs + positions % bs

        # Logits rows: prompt positions to score, then the last row of each sampling sequence.
        plans: list[PromptLogprobsPlan] = []
        prompt_rows: list[np.ndarray] = []
        sample_indices: list[int] = []
        sample_rows: list[int] = []
        num_prompt_rows = 0
        for r, i in enumerate(order):
            req = seqs[i]
            k = req.sampling_params.prompt_logprobs
            if k is not None:
                start, n = int(starts[r]), int(q_lens[r])
                first = max(start, prompt_scored.get(req.seq_id, 0))
                last = min(start + n, req.num_prompt_tokens - 1)  # position p scores token p+1
                if last > first:
                    rows = np.arange(first, last) - start + cu[r]
                    plans.append(
                        PromptLogprobsPlan(
                            i if owner is None else owner[i],
                            num_prompt_rows,
                            req.all_token_ids[first + 1 : last + 1],
                            k,
                        )
                    )
                    prompt_rows.append(rows)
                    num_prompt_rows += last - first
                    prompt_scored[req.seq_id] = last
            if sample[i]:
                sample_indices.append(i)
                sample_rows.append(int(cu[r + 1]) - 1)
        num_sample_rows: list[int] = []
        if owner is not None:
            # Rows in entry order, so that a sequence's verification rows are consecutive
            # (j = 0..k); then one sample index per scheduled sequence.
            pairs = sorted(zip(sample_indices, sample_rows, strict=True))
            sample_rows = [row for _, row in pairs]
            sample_indices = []
            for e, _ in pairs:
                i = owner[e]
                if sample_indices and sample_indices[-1] == i:
                    num_sample_rows[-1] += 1
                else:
                    sample_indices.append(i)
                    num_sample_rows.append(1)
        logits_rows = np.concatenate(prompt_rows + [np.asarray(sample_rows, np.int64)])
        if owner is not None:
            order = [owner[i] for i in order]

        token_seq_lens = None
        if self.dynamic_rope_len is not None and int(seq_lens.max()) > self.dynamic_rope_len:
            token_seq_lens = np.repeat(seq_lens, q_lens)
        arrays = StepArrays(
            token_ids=token_ids,
            positions=positions,
            slot_mapping=slots,
            query_start_loc=cu,
            seq_lens=seq_lens,
            block_tables=tables,
            logits_rows=logits_rows.astype(np.int64, copy=False),
            num_decodes=len(decodes),
            token_seq_lens=token_seq_lens,
        )
        return arrays, SamplingPlan(order, sample_indices, num_prompt_rows, plans, num_sample_rows)

    def from_arrays(self, a: StepArrays) -> StepBatch:
        """Device tensors and attention metadata for ``a`` (at least one sequence)."""
        cu, seq_lens, tables = a.query_start_loc, a.seq_lens, a.block_tables
        num_seqs = len(seq_lens)
        meta = AttentionMetadata(
            num_tokens=len(a.token_ids),
            num_seqs=num_seqs,
            num_decodes=a.num_decodes,
            max_query_len=int((cu[1:] - cu[:-1]).max()),
            max_seq_len=int(seq_lens.max()),
            block_size=self.block_size,
            query_start_loc=self._to_device(cu.astype(np.int32)),
            seq_lens=self._to_device(seq_lens.astype(np.int32)),
            block_tables=self._to_device(tables.astype(np.int32)),
            slot_mapping=self._to_device(a.slot_mapping),
            query_start_loc_host=cu,
            seq_lens_host=seq_lens,
            block_tables_host=tables,
            token_seq_lens=None if a.token_seq_lens is None else self._to_device(a.token_seq_lens),
        )
        return StepBatch(
            input_ids=self._to_device(a.token_ids),
            positions=self._to_device(a.positions),
            meta=meta,
            logits_rows=self._to_device(a.logits_rows),
        )


class _VerifyRow:
    """Entry j of a speculating sequence: one token at position num_computed_tokens + j
    (its last token for j = 0, else proposal j), over the sequence's block table. As a
    one-token row it runs with the decode rows, attending to every position up to its own:
    all rows' K/V are written before attention, so row j sees proposals 1..j-1."""

    __slots__ = ("all_token_ids", "num_computed_tokens", "block_ids", "sampling_params", "seq_id")

    def __init__(self, req, position: int, token: int) -> None:
        # Indexed by position like a sequence's own list: only [position] is read.
        self.all_token_ids = OneToken(position, token)
        self.num_computed_tokens = position
        self.block_ids = req.block_ids
        self.sampling_params = req.sampling_params
        self.seq_id = req.seq_id


class OneToken:
    """A list-like holding one token at ``position`` (what ``plan`` slices; the draft model's
    passes use it too)."""

    __slots__ = ("position", "token")

    def __init__(self, position: int, token: int) -> None:
        self.position = position
        self.token = token

    def __getitem__(self, sl: slice) -> list[int]:
        assert sl.start == self.position and sl.stop == self.position + 1
        return [self.token]


def _expand_spec(so: SchedulerOutput) -> tuple[list, list[int], list[bool], list[int]]:
    """Entries of a speculative step: each sequence with k proposals becomes k + 1
    one-token ``_VerifyRow`` entries (each sampling), the others stay as they are.
    Returns entries, their token counts, their sample flags and their scheduler indices."""
    seqs: list = []
    counts: list[int] = []
    sample: list[bool] = []
    owner: list[int] = []
    for i, (req, n, smp, drafts) in enumerate(
        zip(so.seqs, so.num_scheduled_tokens, so.sample, so.spec_token_ids, strict=True)
    ):
        if not drafts:
            seqs.append(req)
            counts.append(n)
            sample.append(smp)
            owner.append(i)
            continue
        nc = req.num_computed_tokens
        for j, tok in enumerate([req.all_token_ids[nc], *drafts]):
            seqs.append(_VerifyRow(req, nc + j, tok))
            counts.append(1)
            sample.append(True)
            owner.append(i)
    return seqs, counts, sample, owner
