"""KV efficiency: the share of allocated KV slots that hold live tokens.

Runs the throughput workload (random prompts of 64-512 tokens, outputs of 32-256, 64
requests) through the engine's scheduler and KV cache manager, with a stand-in sampler in
place of the model (block accounting does not depend on the forward; see
pagectl/bench/simulate.py). After every step it counts the slots of blocks in use and the
slots holding a computed token. Reported at the step of peak allocation and averaged over
all steps, against two contiguous layouts for the same running requests at the same instant:
- a max-length reservation: every running request reserves the workload's longest possible
  sequence (max prompt + max output), as systems without paging do;
- an exact reservation: every running request reserves its own prompt + max_tokens (the
  best a contiguous layout can do, knowing each output length in advance).

Usage:
    python benchmarks/kv_efficiency.py [--num-requests 64] [--block-sizes 16] [--json]
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
from pagectl.bench.workload import WorkloadSpec, random_workload

TARGET = 0.96


def measure(
    spec: WorkloadSpec, block_size: int, num_blocks: int | None = None, budget: int = 2048
) -> dict:
    """Run ``spec``'s workload at ``block_size`` and summarise KV usage."""
    workload = random_workload(spec)
    nb = num_blocks or blocks_for(workload, block_size)
    sched = make_scheduler(num_blocks=nb, block_size=block_size, max_num_batched_tokens=budget)
    add_workload(sched, workload)
    samples: list[KVSample] = []
    steps = run_to_completion(sched, samples.append)
    max_len = spec.max_input_len + spec.max_output_len
    busy = [s for s in samples if s.num_running]
    peak = max(busy, key=lambda s: (s.allocated_slots, s.live_tokens))
    alloc_sum = sum(s.allocated_slots for s in busy)
    live_sum = sum(s.live_tokens for s in busy)
    reserve_max = sum(s.num_running * max_len for s in busy)
    reserve_own = sum(s.running_full_len for s in busy)
    return {
        "block_size": block_size,
        "num_kv_blocks": nb,
        "steps": steps,
        "preemptions": sched.counters.preemptions,
        "peak": {
            "step": peak.step,
            "num_running": peak.num_running,
            "allocated_slots": peak.allocated_slots,
            "live_tokens": peak.live_tokens,
            "paged_share": peak.live_tokens / peak.allocated_slots,
            "contiguous_max_len_slots": peak.num_running * max_len,
            "contiguous_max_len_share": peak.live_tokens / (peak.num_running * max_len),
            "contiguous_own_len_slots": peak.running_full_len,
            "contiguous_own_len_share": peak.live_tokens / peak.running_full_len,
        },
        # Averages over all steps with running requests, weighted by slots.
        "mean": {
            "paged_share": live_sum / alloc_sum,
            "contiguous_max_len_share": live_sum / reserve_max,
            "contiguous_own_len_share": live_sum / reserve_own,
        },
        "target": TARGET,
        "met": peak.live_tokens / peak.allocated_slots >= TARGET,
    }


def render(spec: WorkloadSpec, results: list[dict]) -> str:
    max_len = spec.max_input_len + spec.max_output_len
    rows = []
    for r in results:
        p, m = r["peak"], r["mean"]
        rows.append(
            [
                f"paged, block {r['block_size']}",
                p["allocated_slots"],
                p["live_tokens"],
                f"{100 * p['paged_share']:.1f}%",
                f"{100 * m['paged_share']:.1f}%",
            ]
        )
    ref = next((r for r in results if r["block_size"] == 16), results[0])
    p, m = ref["peak"], ref["mean"]
    rows.append(
        [
            f"contiguous, max length ({max_len})",
            p["contiguous_max_len_slots"],
            p["live_tokens"],
            f"{100 * p['contiguous_max_len_share']:.1f}%",
            f"{100 * m['contiguous_max_len_share']:.1f}%",
        ]
    )
    rows.append(
        [
            "contiguous, own prompt + max_tokens",
            p["contiguous_own_len_slots"],
            p["live_tokens"],
            f"{100 * p['contiguous_own_len_share']:.1f}%",
            f"{100 * m['contiguous_own_len_share']:.1f}%",
        ]
    )
    head = (
        f"workload: {spec.num_requests} requests, prompts {spec.min_input_len}-{spec.max_input_len}, "
        f"outputs {spec.min_output_len}-{spec.max_output_len}; block {ref['block_size']} peaks at step "
        f"{p['step']} with {p['num_running']} running (contiguous rows: those requests at that instant)"
    )
    table = format_table(
        ["layout", "slots at peak", "live tokens", "live share at peak", "mean live share"], rows
    )
    verdict = "met" if ref["met"] else "NOT met"
    tail = f"target: >= {100 * TARGET:.0f}% live at block size {ref['block_size']}: {verdict}"
    return "\n".join([head, table, tail])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-input-len", type=int, default=64)
    ap.add_argument("--max-input-len", type=int, default=512)
    ap.add_argument("--min-output-len", type=int, default=32)
    ap.add_argument("--max-output-len", type=int, default=256)
    ap.add_argument("--seed", dest="workload_seed", type=int, default=0)
    ap.add_argument("--block-sizes", default="16", help="comma-separated, e.g. 8,16,32")
    ap.add_argument(
        "--num-kv-blocks", type=int, default=None, help="pool size (default: fits the workload)"
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    spec = workload_spec(args, vocab_size=16384)
    sizes = [int(x) for x in args.block_sizes.split(",") if x.strip()]
    results = [measure(spec, bs, args.num_kv_blocks, args.max_num_batched_tokens) for bs in sizes]
    print(render(spec, results))
    if args.json:
        print(
            dumps(
                {
                    "benchmark": "kv_efficiency",
                    "workload": asdict(spec),
                    "machine": machine_info(),
                    "results": results,
                }
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
