"""Run the engine's real scheduler and KV cache manager without a model.

Block accounting does not depend on what the model computes: which blocks a sequence holds,
when they are shared, copied or freed is decided by the scheduler and the KV manager from
token counts alone. Driving them with a stand-in sampler therefore gives the exact KV usage
the engine has on the same workload, in milliseconds instead of minutes of forwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagectl.bench.workload import BenchRequest
from pagectl.engine.config import CacheConfig, SchedulerConfig
from pagectl.engine.outputs import ModelRunnerOutput, SchedulerOutput
from pagectl.engine.request import Request
from pagectl.engine.sampling_params import SamplingParams
from pagectl.engine.scheduler import Scheduler


def make_scheduler(
    *,
    num_blocks: int,
    block_size: int = 16,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    max_model_len: int = 1 << 20,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            long_prefill_token_threshold=0,
            policy="fcfs",
        ),
        CacheConfig(
            block_size=block_size,
            num_kv_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
        ),
    )


def blocks_for(workload: list[BenchRequest], block_size: int, n: int = 1) -> int:
    """Blocks that hold every request of ``workload`` at full length at once (n samples each)."""
    return sum(n * -(-(r.prompt_len + r.output_len) // block_size) for r in workload)


def add_workload(
    sched: Scheduler, workload: list[BenchRequest], n: int = 1, prefix: str = "r"
) -> None:
    for i, r in enumerate(workload):
        sp = SamplingParams(
            n=n, max_tokens=r.output_len, ignore_eos=True, temperature=1.0 if n > 1 else 0.0
        )
        sched.add_request(Request(f"{prefix}{i}", list(r.prompt_token_ids), sp))


def _stand_in_token(req: Request) -> int:
    # Never a stop token (ignore_eos anyway); differs between siblings and positions.
    return 1 + (len(req.all_token_ids) * 7 + req.index * 13) % 1000


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step with the stand-in sampler in place of the model."""
    so = sched.schedule()
    ro = ModelRunnerOutput(
        [_stand_in_token(r) if s else -1 for r, s in zip(so.seqs, so.sample, strict=True)]
    )
    sched.update_from_output(so, ro)
    return so


@dataclass
class KVSample:
    """KV usage after one step."""

    step: int
    # Blocks held by at least one sequence, and their token slots.
    used_blocks: int
    allocated_slots: int
    # Slots holding a computed token of a live sequence (a shared block counted once).
    live_tokens: int
    # Running sequences, and the sum of their own full lengths (prompt + max_tokens).
    num_running: int
    running_full_len: int
    # Copy-on-write block copies the step asked the runner for.
    num_block_copies: int = 0


def kv_sample(sched: Scheduler, step_no: int, num_block_copies: int = 0) -> KVSample:
    bs = sched.block_size
    filled: dict[int, int] = {}
    full_len = 0
    for req in sched.running:
        nc = req.num_computed_tokens
        full_len += req.max_num_tokens
        for i, bid in enumerate(req.block_ids):
            f = min(bs, max(0, nc - i * bs))
            if f > filled.get(bid, -1):
                filled[bid] = f
    used = sched.kv.pool.num_used_blocks
    return KVSample(
        step_no,
        used,
        used * bs,
        sum(filled.values()),
        len(sched.running),
        full_len,
        num_block_copies,
    )


def run_to_completion(
    sched: Scheduler, on_step: Callable[[KVSample], None] | None = None, max_steps: int = 1_000_000
) -> int:
    """Step until nothing is left; returns the number of steps."""
    n = 0
    while sched.has_unfinished():
        so = step(sched)
        n += 1
        if on_step is not None:
            on_step(kv_sample(sched, n, len(so.block_copies)))
        if n >= max_steps:
            raise RuntimeError(f"workload not finished after {max_steps} steps")
    return n
