"""Cost of one telemetry snapshot (``EngineCore.snapshot()``) on the engine thread.

Cases (block size 16, prefix caching on, no model: the scheduler is driven with a stand-in
sampled token):
- seqs256_blocks129: 256 running sequences of 2,064 tokens (129 blocks each, the first 8
  blocks shared by all through the prefix cache) in a pool just large enough for them;
- pool_1m_blocks: the same 256 sequences in a pool of 1,000,000 blocks.

Usage:
    python benchmarks/snapshot_cost.py [--repeats N] [--json]
With --json the last line is one JSON object with each case's median milliseconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

from pagectl.bench.simulate import make_scheduler
from pagectl.engine.core import EngineCore
from pagectl.engine.outputs import ModelRunnerOutput, SchedulerOutput
from pagectl.engine.sampling_params import SamplingParams

BLOCK_SIZE = 16
NUM_SEQS = 256
BLOCKS_PER_SEQ = 129
SHARED_BLOCKS = 8


class _NoModel:
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput([7 if s else -1 for s in so.sample])


def build(num_blocks: int, seed: int = 0) -> EngineCore:
    rng = random.Random(seed)
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=1 << 16,
        max_num_seqs=NUM_SEQS,
    )
    core = EngineCore(sched, _NoModel(), vocab_size=32000)
    sp = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0)
    shared = [rng.randrange(1, 30000) for _ in range(SHARED_BLOCKS * BLOCK_SIZE)]
    # 2,064 tokens: 128 full blocks and one more slot once the next token is sampled.
    prompt_len = (BLOCKS_PER_SEQ - 1) * BLOCK_SIZE + 16
    # The shared prefix is cached once the first request has computed it.
    core.add_request(
        "r0", shared + [rng.randrange(1, 30000) for _ in range(prompt_len - len(shared))], sp
    )
    while sched.running == [] or sched.running[0].num_computed_tokens < prompt_len - 1:
        core.step()
    for i in range(1, NUM_SEQS):
        rest = [rng.randrange(1, 30000) for _ in range(prompt_len - len(shared))]
        core.add_request(f"r{i}", shared + rest, sp)
    while sched.num_waiting or any(r.num_output_tokens == 0 for r in sched.running):
        core.step()
    assert sched.num_running == NUM_SEQS
    return core


def measure(core: EngineCore, repeats: int) -> dict[str, float]:
    for _ in range(5):
        core.snapshot()
    gc.collect()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        core.snapshot()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"median_ms": statistics.median(times), "p90_ms": times[int(len(times) * 0.9)]}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tight = NUM_SEQS * (BLOCKS_PER_SEQ + 1)
    results = {}
    for name, num_blocks in (("seqs256_blocks129", tight), ("pool_1m_blocks", 1_000_000)):
        core = build(num_blocks)
        used = core.scheduler.kv.pool.num_used_blocks
        res = measure(core, args.repeats)
        results[name] = res
        print(
            f"{name}: {NUM_SEQS} seqs, {used} blocks in use of {num_blocks}: "
            f"median {res['median_ms']:.3f} ms, p90 {res['p90_ms']:.3f} ms per snapshot"
        )
    if args.json:
        print(json.dumps({k: round(v["median_ms"], 4) for k, v in results.items()}))


if __name__ == "__main__":
    main()
