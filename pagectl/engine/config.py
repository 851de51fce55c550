"""Engine configuration as the scheduler holds it: sizes fixed at start-up and the values of
the live settings (see live_config.py for which fields change live and their bounds).

No defaults here: every value comes from ``EngineArgs`` (pagectl/engine/args.py, through
``builder.build_engine``) or from a test or benchmark that sets it explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    """Scheduler limits. Fields marked live change between steps (``Scheduler.set``)."""

    # Live. Token budget of one step, prefill chunks and decodes together.
    max_num_batched_tokens: int
    # Live, up to its start-up value. Most sequences running at once.
    max_num_seqs: int
    # Longest sequence (prompt + output) a request may reach.
    max_model_len: int
    # Live. Most tokens one request may prefill in one step (0: no cap beyond the budget).
    long_prefill_token_threshold: int
    # "fcfs" or "priority" (lower value first, ties by arrival); args.SCHEDULING_POLICIES.
    policy: str


@dataclass
class CacheConfig:
    """KV cache shape."""

    # Token slots per block.
    block_size: int
    # Blocks in the pool.
    num_kv_blocks: int
    # Whether full blocks are registered and looked up by content hash, at start-up (changed
    # live through ``Scheduler.set``, which the KV manager then holds).
    enable_prefix_caching: bool

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
