"""The engine's internal view of one sequence. Never leaves the engine process.

A request with ``n > 1`` is one sequence until its prompt (all but the last token) is computed;
then it forks into ``n`` sequences that share its KV blocks (see ``Scheduler._fork``). Each of
them is a ``Request`` with the same ``request_id`` and its own ``index``.
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING, Any

from pagectl.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagectl.engine.kv.block_pool import KVBlock

_arrival_counter = itertools.count()


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue after losing its blocks
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence: its tokens, progress, blocks and stop conditions."""

    __slots__ = (
        "request_id",
        "index",
        "seq_id",
        "sampling_params",
        "all_token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "admitted",
        "blocks",
        "block_ids",
        "block_hashes",
        "num_registered_blocks",
        "cache_salt",
        "priority",
        "arrival_time",
        "arrival_seq",
        "status",
        "num_preemptions",
        "stop_ids",
        "max_num_tokens",
        "min_num_tokens",
        "pending_forks",
        "stop_reason",
        "error",
        "grammar",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        max_model_len: int | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        index: int = 0,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        sp = sampling_params
        self.request_id = request_id
        self.index = index
        # Unique key of this sequence inside the engine (children of a fork get "#i").
        self.seq_id = request_id if index == 0 else f"{request_id}#{index}"
        self.sampling_params = sp
        # Prompt followed by the generated tokens; only ever appended to.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # Tokens whose K/V are in this sequence's blocks. Tokens in [num_computed_tokens,
        # len(all_token_ids)) still have to be fed to the model.
        self.num_computed_tokens = 0
        # Prompt tokens served by the prefix cache at first admission (0 until then), and
        # whether that admission happened (a preempted sequence stays admitted).
        self.num_cached_tokens = 0
        self.admitted = False
        # Block table (append-only except copy-on-write of the last block): blocks[i] holds
        # token slots [i * block_size, (i + 1) * block_size). block_ids mirrors it as ints.
        self.blocks: list[KVBlock] = []
        self.block_ids: list[int] = []
        # Chained hashes of this sequence's full blocks (content hashes; computed lazily).
        self.block_hashes: list[bytes] = []
        # Leading blocks already offered to the prefix cache.
        self.num_registered_blocks = 0
        self.cache_salt = cache_salt
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_seq = next(_arrival_counter)
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        stop = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stop.update(eos_token_ids)
        # Token ids that finish the sequence once min_tokens are out.
        self.stop_ids = frozenset(stop)
        limit = max_model_len if max_model_len is not None else 1 << 62
        if sp.max_tokens is not None:
            limit = min(limit, self.num_prompt_tokens + sp.max_tokens)
        # The sequence finishes with "length" when it holds this many tokens.
        self.max_num_tokens = limit
        self.min_num_tokens = self.num_prompt_tokens + sp.min_tokens
        # n for a parent that has not forked yet; 1 afterwards (and for n == 1).
        self.pending_forks = sp.n
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # The structured-outputs matcher (a ``GrammarState``) when the request is
        # constrained; it has accepted exactly the output tokens so far.
        self.grammar: Any = None

    def fork(self, index: int) -> Request:
        """Sample ``index`` of this request: the same tokens, progress and stop conditions,
        no blocks yet (the KV manager shares the parent's, ``KVCacheManager.fork``), forked
        once and for all (``pending_forks`` 1). Lists and the grammar matcher's state are the
        child's own."""
        child = Request.__new__(Request)
        for slot in Request.__slots__:
            setattr(child, slot, getattr(self, slot))
        child.index = index
        child.seq_id = f"{self.request_id}#{index}"
        child.all_token_ids = list(self.all_token_ids)
        child.blocks = []
        child.block_ids = []
        child.block_hashes = list(self.block_hashes)
        child.pending_forks = 1
        if self.grammar is not None:
            child.grammar = self.grammar.fork()
        return child

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def target_num_tokens(self) -> int:
        """How far this sequence must be computed before it can sample or fork.

        An unforked parent (n > 1) stops one token short of its prompt: each child then feeds
        the last prompt token itself and samples from its own logits.
        """
        if self.pending_forks > 1:
            return self.num_prompt_tokens - 1
        return len(self.all_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def priority_key(self) -> tuple[int, float, int]:
        """Lower sorts first: served first, preempted last."""
        return (self.priority, self.arrival_time, self.arrival_seq)

    def __repr__(self) -> str:
        return (
            f"Request({self.seq_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )
