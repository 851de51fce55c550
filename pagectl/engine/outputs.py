"""Boundary types between the scheduler, the model runner and the engine's callers.

``SchedulerOutput`` and ``ModelRunnerOutput`` stay inside the engine process (the runner reads
the scheduled ``Request`` objects directly). ``EngineRequest`` and ``EngineCoreOutput`` cross
the process boundary to the API server, so they are msgspec structs of plain values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from pagectl.engine.request import Request


@dataclass
class SchedulerOutput:
    """What one engine step computes."""

    # Monotonic step number.
    step_id: int
    # Scheduled sequences in batch order. For each, the runner feeds
    # all_token_ids[num_computed_tokens : num_computed_tokens + n] (n below) at positions
    # starting at num_computed_tokens, writing K/V into the slots of req.block_ids.
    seqs: list[Request]
    # Tokens fed per scheduled sequence this step (same order as ``seqs``).
    num_scheduled_tokens: list[int]
    # Whether each sequence samples a token this step (its computed tokens reach its end).
    sample: list[bool]
    # Sum of num_scheduled_tokens.
    total_num_scheduled_tokens: int
    # Copy-on-write block copies (src block id, dst block id) to apply before the forward.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Sequences that left the engine since the previous step: runners drop per-seq state.
    finished_seq_ids: list[str] = field(default_factory=list)
    # Speculative decoding: empty when no sequence speculates this step, else one list per
    # scheduled sequence (same order as ``seqs``) of proposed tokens, [] for most. A sequence
    # with k proposals feeds its last token and then them (its n counts them: n == 1 + k),
    # and samples k + 1 tokens that the runner verifies against the proposals.
    spec_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities for one position."""

    # Log-probability of the token actually at this position (sampled or prompt token).
    logprob: float
    # Rank of that token among the vocabulary (1 = most likely).
    rank: int
    # Top-k alternatives as (token id, logprob), most likely first.
    top: list[tuple[int, float]]


@dataclass
class ModelRunnerOutput:
    """What the runner returns for one ``SchedulerOutput``."""

    # One entry per scheduled sequence: the sampled token, or -1 where ``sample`` was False.
    sampled_token_ids: list[int]
    # Per scheduled sequence, logprobs of the sampled token when the request asked for them.
    logprobs: list[TokenLogprobs | None] | None = None
    # seq_id -> logprobs of the prompt tokens covered by this step's chunk (position order;
    # the first prompt token has none and is skipped).
    prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None
    # Speculative decoding (None when the step had no proposals): per scheduled sequence
    # that had proposals, the tokens it gains, in order: the accepted proposals, then the
    # token sampled after them (1 to k + 1 tokens); [] for the others (which use
    # ``sampled_token_ids``). ``spec_logprobs`` gives their logprobs when asked for.
    spec_output_token_ids: list[list[int]] | None = None
    spec_logprobs: list[list[TokenLogprobs] | None] | None = None


class EngineRequest(msgspec.Struct, kw_only=True):
    """A request as submitted to the engine core (validated and tokenized already)."""

    # Caller-chosen id, unique among live requests.
    request_id: str
    # Prompt token ids (non-empty, inside the vocabulary).
    prompt_token_ids: list[int]
    # Sampling parameters as a plain dict of ``SamplingParams`` fields.
    sampling_params: dict
    # Lower value is served first under the priority policy.
    priority: int = 0
    # Requests with different salts never share prefix-cache blocks.
    cache_salt: str | None = None
    # Wall-clock arrival (time.time()) at the API server. The engine measures ages with its
    # own monotonic clock; this is carried for logs and diagnostics.
    arrival_time: float | None = None
    # Beam search instead of sampling: ``BeamSearchParams`` fields (sampling_params then
    # only sizes the request: n = beam_width). Its n sequences arrive once, at the end.
    beam_search: dict | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New results for one sequence after a step (holds no cycles: not GC-tracked)."""

    # The request's id and the index of this sequence among its n samples.
    request_id: str
    index: int
    # Tokens generated since the previous output for this sequence.
    new_token_ids: list[int]
    # "stop", "length", "abort" or "error" once finished, else None.
    finish_reason: str | None = None
    # The stop token id that ended the sequence (stop strings are found by the caller).
    stop_reason: int | str | None = None
    # Logprobs of each new token when requested.
    new_logprobs: list[TokenLogprobs] | None = None
    # Logprobs of the prompt tokens scored in this step (chunks arrive in order; the caller
    # concatenates them). Only sequence index 0 carries them.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Prompt length and prompt tokens served by the prefix cache.
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Human-readable cause when finish_reason == "error".
    error: str | None = None
    # Beam search: the sequence's cumulative logprob (its tokens come in one output).
    cumulative_logprob: float | None = None
