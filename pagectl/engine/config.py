"""Engine configuration: what is fixed at start-up and what an operator may change live."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    """Scheduler limits. Fields marked live can change between steps (``Scheduler.set``)."""

    # Live. Token budget of one step, prefill chunks and decodes together.
    max_num_batched_tokens: int = 2048
    # Live, up to its start-up value. Most sequences running at once.
    max_num_seqs: int = 256
    # Longest sequence (prompt + output) a request may reach.
    max_model_len: int = 4096
    # Live. Most tokens one request may prefill in one step (0: no cap beyond the budget).
    long_prefill_token_threshold: int = 0
    # "fcfs" or "priority" (lower value first, ties by arrival).
    policy: str = "fcfs"
    # Upper bound for a live max_num_batched_tokens (default: 4x the start-up budget).
    max_num_batched_tokens_limit: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if not self.max_num_batched_tokens_limit:
            self.max_num_batched_tokens_limit = 4 * self.max_num_batched_tokens


@dataclass
class CacheConfig:
    """KV cache shape."""

    # Token slots per block.
    block_size: int = 16
    # Blocks in the pool.
    num_kv_blocks: int = 1024
    # Whether full blocks are registered and looked up by content hash, at start-up (changed
    # live through ``Scheduler.set``, which the KV manager then holds).
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
