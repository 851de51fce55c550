"""Benchmark workloads: lists of requests with their token-id prompts and output lengths.

The default shape is the one nano-vllm and vLLM's throughput benchmark use: random token-id
prompts, prompt and output lengths drawn uniformly from ranges, every request generating
exactly its own output length (ignore_eos). A workload depends only on its parameters and
seed, so every engine in a comparison runs the very same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload."""

    # Prompt token ids (all in [0, vocab_size)).
    prompt_token_ids: list[int]
    # Exact number of tokens to generate (ignore_eos: every engine must produce all of them).
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class WorkloadSpec:
    """Parameters of the random workload; equal specs give equal workloads."""

    num_requests: int = 64
    min_input_len: int = 64
    max_input_len: int = 512
    min_output_len: int = 32
    max_output_len: int = 256
    vocab_size: int = 16384
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 1 <= self.min_input_len <= self.max_input_len:
            raise ValueError(
                f"need 1 <= min_input_len <= max_input_len, got {self.min_input_len}, {self.max_input_len}"
            )
        if not 1 <= self.min_output_len <= self.max_output_len:
            raise ValueError(
                f"need 1 <= min_output_len <= max_output_len, got {self.min_output_len}, {self.max_output_len}"
            )
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")


def random_workload(spec: WorkloadSpec, *, low_token_id: int = 1) -> list[BenchRequest]:
    """Random token-id prompts with uniform lengths, nano-vllm style.

    Token ids are drawn from ``[low_token_id, vocab_size)``; the default keeps id 0 (often a
    special token such as EOS or padding) out of prompts.
    """
    rng = random.Random(spec.seed)
    hi = spec.vocab_size - 1
    lo = min(low_token_id, hi)
    out = []
    for _ in range(spec.num_requests):
        n_in = rng.randint(spec.min_input_len, spec.max_input_len)
        n_out = rng.randint(spec.min_output_len, spec.max_output_len)
        out.append(BenchRequest([rng.randint(lo, hi) for _ in range(n_in)], n_out))
    return out


def shared_prefix_workload(
    num_requests: int,
    prefix_len: int,
    min_suffix_len: int,
    max_suffix_len: int,
    output_len: int,
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Requests that all start with the same ``prefix_len``-token system prompt.

    Each request appends its own random suffix (so no two prompts are equal) and generates
    ``output_len`` tokens.
    """
    rng = random.Random(seed)
    prefix = [rng.randint(1, vocab_size - 1) for _ in range(prefix_len)]
    out = []
    for _ in range(num_requests):
        n_suffix = rng.randint(min_suffix_len, max_suffix_len)
        suffix = [rng.randint(1, vocab_size - 1) for _ in range(n_suffix)]
        out.append(BenchRequest(prefix + suffix, output_len))
    return out


def total_output_tokens(workload: list[BenchRequest]) -> int:
    return sum(r.output_len for r in workload)


def total_prompt_tokens(workload: list[BenchRequest]) -> int:
    return sum(r.prompt_len for r in workload)
