"""Scheduler + KV manager overhead per engine step, without a model.

Cases:
- decode_256: 256 running requests in steady decode, contexts 512-2048, block size 16,
  prefix caching on. One step = schedule() + update_from_output() with a fake sampled token per
  request (the model forward is not part of the figure).
- mixed: 64 decoding requests plus new 1024-token prompts arriving so that every step carries
  prefill chunks next to the decodes (budget 2048).

Usage:
    python benchmarks/scheduler_overhead.py [--steps N] [--json]
With --json the last line is one JSON object with decode_256_us_per_step and mixed_us_per_step.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

from pagectl.bench.simulate import make_scheduler
from pagectl.engine.outputs import ModelRunnerOutput
from pagectl.engine.request import Request
from pagectl.engine.sampling_params import SamplingParams
from pagectl.engine.scheduler import Scheduler


def _fake_output(so) -> ModelRunnerOutput:
    # Sampled token ids: cheap and never EOS (ignore_eos anyway).
    return ModelRunnerOutput([7 if s else -1 for s in so.sample])


def _prefill_all(sched: Scheduler) -> None:
    """Step (not timed) until every request decodes one token per step."""
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running) or sched.num_waiting:
        so = sched.schedule()
        sched.update_from_output(so, _fake_output(so))


def _timed_steps(sched: Scheduler, steps: int, between=None) -> list[float]:
    times = []
    gc.collect()
    for _ in range(steps):
        if between is not None:
            between()
        t0 = time.perf_counter()
        so = sched.schedule()
        sched.update_from_output(so, _fake_output(so))
        times.append(time.perf_counter() - t0)
    return times


def _stats(times: list[float]) -> dict[str, float]:
    us = sorted(t * 1e6 for t in times)
    return {
        "mean": statistics.mean(us),
        "median": statistics.median(us),
        "p90": us[int(len(us) * 0.9)],
    }


def bench_decode(num_requests: int, steps: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    sched = make_scheduler(
        num_blocks=num_requests * 160, max_num_batched_tokens=8192, max_num_seqs=num_requests
    )
    sp = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0)
    for i in range(num_requests):
        ctx = rng.randint(512, 2048)
        prompt = [rng.randrange(1, 30000) for _ in range(ctx)]
        sched.add_request(Request(f"r{i}", prompt, sp))
    _prefill_all(sched)
    assert sched.num_running == num_requests
    _timed_steps(sched, 20)  # warm-up
    return _stats(_timed_steps(sched, steps))


def bench_mixed(steps: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=64 * 200, max_num_batched_tokens=2048, max_num_seqs=128)
    sp = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0)
    for i in range(64):
        prompt = [rng.randrange(1, 30000) for _ in range(rng.randint(512, 1024))]
        sched.add_request(Request(f"d{i}", prompt, sp))
    _prefill_all(sched)
    counter = [0]
    short = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)

    def arrive() -> None:
        # Keep one long prompt waiting so every step has a prefill chunk beside the decodes.
        if sched.num_waiting == 0:
            counter[0] += 1
            prompt = [rng.randrange(1, 30000) for _ in range(1024)]
            sched.add_request(Request(f"p{counter[0]}", prompt, short))

    _timed_steps(sched, 10, arrive)
    return _stats(_timed_steps(sched, steps, arrive))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    d256 = bench_decode(256, args.steps)
    d64 = bench_decode(64, args.steps)
    mixed = bench_mixed(args.steps)
    print(f"{'case':<28}{'mean us':>10}{'median us':>11}{'p90 us':>9}{'mean us/req':>13}")
    for name, r, n in (
        ("decode, 256 requests", d256, 256),
        ("decode, 64 requests", d64, 64),
        ("mixed, 64 decode + prefill", mixed, 0),
    ):
        per = f"{r['mean'] / n:>13.2f}" if n else f"{'':>13}"
        print(f"{name:<28}{r['mean']:>10.1f}{r['median']:>11.1f}{r['p90']:>9.1f}{per}")
    print("target: decode_256 <= 300 us/step (mean; the median is robust to other processes)")
    if args.json:
        out = {
            "decode_256_us_per_step": round(d256["mean"], 1),
            "decode_256_us_per_step_median": round(d256["median"], 1),
            "decode_64_us_per_step": round(d64["mean"], 1),
            "mixed_us_per_step": round(mixed["mean"], 1),
            "mixed_us_per_step_median": round(mixed["median"], 1),
        }
        print(json.dumps(out))


if __name__ == "__main__":
    main()
