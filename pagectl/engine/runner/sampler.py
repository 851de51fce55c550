"""Token sampling for one engine step: logits processing, truncation, seeded draws, logprobs.

Each row of a batch follows its own ``SamplingParams``; rows of every kind mix freely. Per row:

1. ``logit_bias`` is added; while the sequence is shorter than ``min_num_tokens`` its stop ids
   are masked to -inf; then the penalties: repetition (HF / vLLM: positive logits divided,
   negative ones multiplied, for every token of prompt and output), frequency and presence
   (OpenAI: subtracted per occurrence / once, counting generated tokens only). Last, rows
   with a structured-outputs grammar get its token bitmask (tokens it forbids go to -inf);
   rows without one skip this step entirely.
2. Greedy rows (``temperature < 1e-5``) take the argmax of those processed logits.
3. Other rows: divide by the temperature; keep the ``top_k`` largest logits; keep the nucleus
   of mass ``top_p`` of what top-k left (renormalised); drop tokens less likely than ``min_p``
   times the most likely one; draw one token from what is left.

Two exact ways to draw, chosen per device: the exponential race ``argmax(p / E)``, E ~ Exp(1)
per token (no host sync, cheap on GPUs), and the inverse CDF, one uniform per row searched in
the float64 cumulative sum (on CPU, generating one exponential per vocabulary entry costs
about five times the rest of the step).

Logprobs describe the model's own distribution: the log-softmax of the raw logits, before any
step above (as vLLM reports them by default).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagectl.engine.outputs import TokenLogprobs
from pagectl.engine.runner.logits_ops import (
    apply_min_p,
    apply_top_k_top_p,
    token_logprobs,
)
from pagectl.engine.structured_outputs.bitmask import apply_grammar_bitmask

if TYPE_CHECKING:
    from pagectl.engine.request import Request

_SEED_MASK = (1 << 64) - 1
# Seeds of stream s are the engine's shifted by s times this odd 64-bit constant.
_STREAM_STRIDE = 0x9E3779B97F4A7C15
DRAW_METHODS = ("race", "inverse_cdf")
_NEG_INF = float("-inf")


@dataclass
class SamplerResult:
    """The sampler's answer for one batch."""

    # One sampled token id per row, in row order; always < the sampler's vocab_size.
    token_ids: list[int]
    # Per row, logprobs of the sampled token where that row's params ask for them, else None;
    # None as a whole when no row asks.
    logprobs: list[TokenLogprobs | None] | None = None


class _BatchPlan:
    """One Python pass over the batch's params: which rows need which work."""

    __slots__ = (
        "greedy_rows",
        "random_rows",
        "temperatures",
        "top_k",
        "top_p",
        "min_p",
        "penalty_rows",
        "bias_rows",
        "min_tokens_rows",
        "logprob_rows",
        "grammar_rows",
    )

    def __init__(self, seqs: Sequence[Request]) -> None:
        self.greedy_rows: list[int] = []
        # Rows drawn at random; temperatures .. min_p hold their values in the same order.
        self.random_rows: list[int] = []
        self.temperatures: list[float] = []
        self.top_k: list[int] = []
        self.top_p: list[float] = []
        self.min_p: list[float] = []
        self.penalty_rows: list[int] = []
        self.bias_rows: list[int] = []
        self.min_tokens_rows: list[int] = []
        self.logprob_rows: list[int] = []
        # Rows constrained by a grammar (``seq.grammar``, its matcher ready).
        self.grammar_rows: list[int] = []
        for i, seq in enumerate(seqs):
            sp = seq.sampling_params
            if sp.greedy:
                self.greedy_rows.append(i)
            else:
                self.random_rows.append(i)
                self.temperatures.append(sp.temperature)
                self.top_k.append(sp.top_k)
                self.top_p.append(sp.top_p)
                self.min_p.append(sp.min_p)
            if sp.needs_penalties:
                self.penalty_rows.append(i)
            if sp.logit_bias:
                self.bias_rows.append(i)
            if seq.stop_ids and len(seq.all_token_ids) < seq.min_num_tokens:
                self.min_tokens_rows.append(i)
            if sp.logprobs is not None:
                self.logprob_rows.append(i)
            if seq.grammar is not None:
                self.grammar_rows.append(i)

    @property
    def needs_processing(self) -> bool:
        return bool(
            self.penalty_rows or self.bias_rows or self.min_tokens_rows or self.grammar_rows
        )


class Sampler:
    """Samples one token per row of a logits batch, each row by its request's params.

    Args:
        vocab_size: Real vocabulary size; logits columns from here on (padding of the LM head)
            are ignored.
        device: Device of the logits.
        seed: Seed of the engine-wide generator used by rows without a per-request seed.
        draw: "race" or "inverse_cdf" (both exact); None picks inverse_cdf on CPU, race
            elsewhere. Seeded outputs depend on it.
        stream: Which random stream seeded sequences draw from (0: the engine's). Two
            samplers that draw for the same sequence (a draft model's and the target's)
            need different streams, or their draws would be the same numbers.
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str = "cpu",
        seed: int = 0,
        *,
        draw: str | None = None,
        stream: int = 0,
    ):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        if draw is None:
            draw = "inverse_cdf" if self.device.type == "cpu" else "race"
        if draw not in DRAW_METHODS:
            raise ValueError(f"draw must be one of {DRAW_METHODS}, got {draw!r}")
        self.draw = draw
        self.stream = stream
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed & _SEED_MASK)
        # seq_id -> generator of a seeded sequence. Created at its first draw, advanced only by
        # its own draws (so its tokens do not depend on the rest of the batch), dropped by
        # forget(). Survives preemption: sampled tokens are never drawn again.
        self._seq_generators: dict[str, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, seqs: Sequence[Request]) -> SamplerResult:
        """Sample the token that follows each sequence.

        Args:
            logits: ``[len(seqs), >= vocab_size]`` logits of each sequence's last fed position.
            seqs: The sequences, one per row.

        Returns:
            One token per row, plus logprobs where requested.
        """
        x = logits[:, : self.vocab_size]
        plan = _BatchPlan(seqs)
        if not plan.random_rows and not plan.needs_processing and not plan.logprob_rows:
            return SamplerResult(x.argmax(dim=-1).tolist())
        processed = self._process(x, seqs, plan, copy=False)
        if plan.random_rows:
            rows = self._index(plan.random_rows, len(seqs))
            picked = processed if rows is None else processed.index_select(0, rows)
            probs = self._truncated_probs(picked, plan)
            drawn = self._draw(probs, [seqs[i] for i in plan.random_rows])
            if rows is None:
                sampled = drawn
            else:
                sampled = processed.argmax(dim=-1).index_copy_(0, rows, drawn)
        else:
            sampled = processed.argmax(dim=-1)
        logprobs = self._logprobs(x, sampled, seqs, plan) if plan.logprob_rows else None
        return SamplerResult(sampled.tolist(), logprobs)

    def forget(self, seq_ids: Iterable[str]) -> None:
        """Drop per-sequence state (seeded generators) of sequences that left the engine."""
        for seq_id in seq_ids:
            self._seq_generators.pop(seq_id, None)

    def process_logits(self, logits: torch.Tensor, seqs: Sequence[Request]) -> torch.Tensor:
        """Float32 ``[rows, vocab_size]`` logits after logit_bias, min_tokens and penalties.

        These are what greedy rows take the argmax of. A new tensor, never a view of ``logits``.
        """
        return self._process(logits[:, : self.vocab_size], seqs, _BatchPlan(seqs), copy=True)

    def sampling_probs(self, logits: torch.Tensor, seqs: Sequence[Request]) -> torch.Tensor:
        """Float32 ``[rows, vocab_size]`` distribution each row is drawn from.

        Greedy rows are one-hot on their argmax. Consumes no randomness.
        """
        plan = _BatchPlan(seqs)
        processed = self._process(logits[:, : self.vocab_size], seqs, plan, copy=True)
        probs = torch.zeros_like(processed)
        probs.scatter_(1, processed.argmax(dim=-1, keepdim=True), 1.0)
        if plan.random_rows:
            rows = torch.tensor(plan.random_rows, device=processed.device)
            picked = processed.index_select(0, rows)
            probs.index_copy_(0, rows, self._truncated_probs(picked, plan))
        return probs

    def draw_from(
        self,
        probs: torch.Tensor,
        seqs: Sequence[Request],
        rows_to_draw: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """One token per row of the ``[rows, vocab]`` distribution ``probs`` (rows need not sum
        to 1; each must have some positive mass), seeded rows from their own generator.

        With ``rows_to_draw`` (indices into ``seqs``), tokens only for those rows,
        in that order; the others' rows of ``probs`` are never read. The random numbers of
        every row are generated all the same, so each stream (a seeded sequence's, the
        engine's) ends where a draw of every row leaves it and later draws get the numbers
        they would get without ``rows_to_draw``.
        """
        return self._draw(probs, list(seqs), rows_to_draw)

    def greedy_tokens(self, logits: torch.Tensor, seqs: Sequence[Request]) -> torch.Tensor:
        """The token a greedy row takes, for every row: the argmax of the processed logits
        (``process_logits``), as ``__call__`` picks for greedy rows, without logprobs.
        Consumes no randomness."""
        x = logits[:, : self.vocab_size]
        plan = _BatchPlan(seqs)
        if not plan.needs_processing:
            return x.argmax(dim=-1)
        return self._process(x, seqs, plan, copy=False).argmax(dim=-1)

    def uniform(self, seqs: Sequence[Request]) -> torch.Tensor:
        """Float64 ``[rows]`` uniforms in [0, 1), seeded rows from their own generator."""
        return self._noise(list(seqs), 1, torch.float64, torch.Tensor.uniform_)[:, 0]

    def logprobs_of(
        self, logits: torch.Tensor, token_ids: torch.Tensor, seqs: Sequence[Request]
    ) -> list[TokenLogprobs | None] | None:
        """Logprobs of ``token_ids`` (one per row) where the rows' params ask for them, as
        ``SamplerResult.logprobs``."""
        plan = _BatchPlan(seqs)
        if not plan.logprob_rows:
            return None
        return self._logprobs(logits[:, : self.vocab_size], token_ids, seqs, plan)

    # -- internals ---------------------------------------------------------------------------

    def _index(self, rows: list[int], num_rows: int) -> torch.Tensor | None:
        """Row indices as a tensor, or None when ``rows`` is every row (no gather needed)."""
        if len(rows) == num_rows:
            return None
        return torch.tensor(rows, device=self.device)

    def _process(
        self, x: torch.Tensor, seqs: Sequence[Request], plan: _BatchPlan, copy: bool
    ) -> torch.Tensor:
        # Without copy and without work this aliases the caller's logits: callers only read it.
        if not plan.needs_processing:
            return x.to(torch.float32, copy=copy)
        out = x.to(torch.float32, copy=True)
        vocab = out.shape[1]
        if plan.bias_rows:
            rows: list[int] = []
            ids: list[int] = []
            values: list[float] = []
            for i in plan.bias_rows:
                for tid, bias in seqs[i].sampling_params.logit_bias.items():  # type: ignore[union-attr]
                    if 0 <= tid < vocab:
                        rows.append(i)
                        ids.append(tid)
                        values.append(bias)
            index = (self._tensor(rows), self._tensor(ids))
            out.index_put_(index, self._tensor(values, torch.float32), accumulate=True)
        if plan.min_tokens_rows:
            rows, ids = [], []
            for i in plan.min_tokens_rows:
                for tid in seqs[i].stop_ids:
                    if 0 <= tid < vocab:
                        rows.append(i)
                        ids.append(tid)
            out[self._tensor(rows), self._tensor(ids)] = _NEG_INF
        if plan.penalty_rows:
            self._apply_penalties(out, seqs, plan.penalty_rows)
        if plan.grammar_rows:
            apply_grammar_bitmask(out, seqs, plan.grammar_rows, self.vocab_size)
        return out

    def _apply_penalties(self, out: torch.Tensor, seqs: Sequence[Request], rows: list[int]):
        params = [seqs[i].sampling_params for i in rows]
        index = self._index(rows, out.shape[0])
        sub = out if index is None else out.index_select(0, index)
        if any(sp.repetition_penalty != 1.0 for sp in params):
            # Rows with repetition_penalty == 1 contribute no tokens, so nothing changes there.
            seen = (
                self._token_counts(
                    [
                        seqs[i].all_token_ids if sp.repetition_penalty != 1.0 else []
                        for i, sp in zip(rows, params, strict=True)
                    ],
                    out.shape[1],
                )
                > 0
            )
            rep = self._tensor([sp.repetition_penalty for sp in params], torch.float32)[:, None]
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        if any(sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0 for sp in params):
            counts = self._token_counts(
                [seqs[i].all_token_ids[seqs[i].num_prompt_tokens :] for i in rows],
                out.shape[1],
            )
            freq = self._tensor([sp.frequency_penalty for sp in params], torch.float32)[:, None]
            pres = self._tensor([sp.presence_penalty for sp in params], torch.float32)[:, None]
            sub = sub - freq * counts - pres * (counts > 0)
        if index is None:
            out.copy_(sub)
        else:
            out.index_copy_(0, index, sub)

    def _token_counts(self, token_lists: list[list[int]], vocab: int) -> torch.Tensor:
        """Float32 ``[len(token_lists), vocab]``: occurrences of each id in each list."""
        num_rows = len(token_lists)
        counts = torch.zeros(num_rows * vocab + 1, dtype=torch.float32, device=self.device)
        lengths = self._tensor([len(t) for t in token_lists])
        flat = self._tensor(list(itertools.chain.from_iterable(token_lists)))
        if flat.numel():
            row = torch.repeat_interleave(torch.arange(num_rows, device=self.device), lengths)
            # Out-of-vocabulary ids land in the spare last slot, never in a neighbouring row.
            valid = (flat >= 0) & (flat < vocab)
            slot = torch.where(valid, row * vocab + flat, num_rows * vocab)
            counts.index_add_(0, slot, torch.ones_like(slot, dtype=torch.float32))
        return counts[:-1].view(num_rows, vocab)

    def _truncated_probs(self, picked: torch.Tensor, plan: _BatchPlan) -> torch.Tensor:
        """Probabilities of the random rows after temperature, top-k, top-p and min-p."""
        temperatures = self._tensor(plan.temperatures, torch.float32)[:, None]
        # A new tensor: the in-place masking below never reaches the caller's logits.
        scaled = picked / temperatures
        apply_top_k_top_p(scaled, plan.top_k, plan.top_p)
        apply_min_p(scaled, plan.min_p)
        return torch.softmax(scaled, dim=-1)

    def _draw(
        self, probs: torch.Tensor, seqs: list[Request], rows: Sequence[int] | None = None
    ) -> torch.Tensor:
        """One token per row of ``probs`` (per row in ``rows`` when given, as ``draw_from``);
        a zero-probability token is never drawn."""
        # The noise of every row, drawn or not: skipping a row's would shift its stream.
        index = None if rows is None else self._tensor(list(rows))
        if index is not None:
            probs = probs.index_select(0, index)
        if self.draw == "race":
            q = self._noise(seqs, probs.shape[1], torch.float32, torch.Tensor.exponential_)
            if index is not None:
                q = q.index_select(0, index)
            # E == 0 would turn a zero probability into NaN (0 / 0) and win the argmax.
            q.clamp_(min=torch.finfo(q.dtype).tiny)
            return (probs / q).argmax(dim=-1)
        u = self._noise(seqs, 1, torch.float64, torch.Tensor.uniform_)
        if index is not None:
            u = u.index_select(0, index)
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        total = cdf[:, -1:]
        # target < total, so the first cdf entry above it belongs to a token of positive mass.
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True)[:, 0]

    def _noise(self, seqs: list[Request], width: int, dtype: torch.dtype, fill) -> torch.Tensor:
        """``[len(seqs), width]`` random values; seeded rows draw from their own generator."""
        out = torch.empty((len(seqs), width), dtype=dtype, device=self.device)
        unseeded = [j for j, s in enumerate(seqs) if s.sampling_params.seed is None]
        if len(unseeded) == len(seqs):
            fill(out, generator=self.generator)
            return out
        if unseeded:
            shared = torch.empty((len(unseeded), width), dtype=dtype, device=self.device)
            fill(shared, generator=self.generator)
            out.index_copy_(0, self._tensor(unseeded), shared)
        for j, seq in enumerate(seqs):
            if seq.sampling_params.seed is not None:
                fill(out[j], generator=self._seq_generator(seq))
        return out

    def _seq_generator(self, seq: Request) -> torch.Generator:
        gen = self._seq_generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            seed = seq.sampling_params.seed + seq.index + self.stream * _STREAM_STRIDE  # type: ignore[operator]
            gen.manual_seed(seed & _SEED_MASK)
            self._seq_generators[seq.seq_id] = gen
        return gen

    def _logprobs(
        self, x: torch.Tensor, sampled: torch.Tensor, seqs: Sequence[Request], plan: _BatchPlan
    ) -> list[TokenLogprobs | None]:
        rows = plan.logprob_rows
        index = self._index(rows, len(seqs))
        raw = x if index is None else x.index_select(0, index)
        targets = sampled if index is None else sampled.index_select(0, index)
        logprobs = torch.log_softmax(raw.float(), dim=-1)
        nums = [seqs[i].sampling_params.logprobs for i in rows]
        result: list[TokenLogprobs | None] = [None] * len(seqs)
        for i, entry in zip(rows, token_logprobs(logprobs, targets, nums), strict=True):  # type: ignore[arg-type]
            result[i] = entry
        return result

    def _tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)
