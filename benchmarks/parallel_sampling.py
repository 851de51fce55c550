"""Parallel sampling: KV memory saved by sharing the prompt's blocks between n samples.

Each prompt asks for n samples (n = 4 and 8). Shared: one request with ``n`` forks after its
prompt is computed; the children share the prompt's blocks (refcounts) and copy the
partially filled last block on their first write (copy-on-write). Independent: ``n``
separate requests with the same prompt and prefix caching off, so nothing is shared (as in a
system without block sharing). Both run the same random workload through the engine's
scheduler and KV cache manager with a stand-in sampler (block usage does not depend on the
forward; see pagectl/bench/simulate.py). Prefix caching is off in both, so the only sharing
measured is the fork's.

Reported: blocks in use at the peak and summed over all steps (block-steps), and the share
saved by sharing.

Usage:
    python benchmarks/parallel_sampling.py [--num-requests 16] [--n 4,8] [--json]
With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from pagectl.bench.options import workload_spec
from pagectl.bench.report import dumps, format_table, machine_info
from pagectl.bench.simulate import (
    KVSample,
    add_workload,
    blocks_for,
    make_scheduler,
    run_to_completion,
)
from pagectl.bench.workload import BenchRequest, WorkloadSpec, random_workload


def _run(workload: list[BenchRequest], n: int, shared: bool, block_size: int, budget: int) -> dict:
    sched = make_scheduler(
        num_blocks=blocks_for(workload, block_size, n) + len(workload) * n,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max(256, len(workload) * n),
        enable_prefix_caching=False,
    )
    if shared:
        add_workload(sched, workload, n=n)
    else:
        for j in range(n):
            add_workload(sched, workload, n=1, prefix=f"s{j}-")
    samples: list[KVSample] = []
    steps = run_to_completion(sched, samples.append)
    assert sched.counters.preemptions == 0, "the pool is sized so that nothing is preempted"
    return {
        "steps": steps,
        "peak_blocks": max(s.used_blocks for s in samples),
        "block_steps": sum(s.used_blocks for s in samples),
        "block_copies": sum(s.num_block_copies for s in samples),
        "generated_tokens": sched.counters.generation_tokens,
    }


def measure(workload: list[BenchRequest], n: int, block_size: int = 16, budget: int = 2048) -> dict:
    ind = _run(workload, n, False, block_size, budget)
    sh = _run(workload, n, True, block_size, budget)
    return {
        "n": n,
        "independent": ind,
        "shared": sh,
        "peak_saved": 1 - sh["peak_blocks"] / ind["peak_blocks"],
        "block_steps_saved": 1 - sh["block_steps"] / ind["block_steps"],
    }


def render(spec: WorkloadSpec, results: list[dict]) -> str:
    rows = []
    for r in results:
        ind, sh = r["independent"], r["shared"]
        rows.append(
            [
                r["n"],
                ind["peak_blocks"],
                sh["peak_blocks"],
                f"{100 * r['peak_saved']:.1f}%",
                ind["block_steps"],
                sh["block_steps"],
                f"{100 * r['block_steps_saved']:.1f}%",
                sh["block_copies"],
            ]
        )
    head = (
        f"workload: {spec.num_requests} prompts of {spec.min_input_len}-{spec.max_input_len} tokens, "
        f"{spec.min_output_len}-{spec.max_output_len} output tokens per sample; block size 16"
    )
    table = format_table(
        [
            "n",
            "peak blocks indep.",
            "peak blocks shared",
            "saved at peak",
            "block-steps indep.",
            "block-steps shared",
            "saved overall",
            "CoW copies",
        ],
        rows,
    )
    return head + "\n" + table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--min-input-len", type=int, default=64)
    ap.add_argument("--max-input-len", type=int, default=512)
    ap.add_argument("--min-output-len", type=int, default=32)
    ap.add_argument("--max-output-len", type=int, default=256)
    ap.add_argument("--seed", dest="workload_seed", type=int, default=0)
    ap.add_argument("--n", default="4,8", help="comma-separated sample counts")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    spec = workload_spec(args, vocab_size=16384)
    workload = random_workload(spec)
    results = [measure(workload, int(n), args.block_size) for n in args.n.split(",") if n.strip()]
    print(render(spec, results))
    if args.json:
        print(
            dumps(
                {
                    "benchmark": "parallel_sampling",
                    "workload": asdict(spec),
                    "machine": machine_info(),
                    "results": results,
                }
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
