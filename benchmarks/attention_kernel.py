"""The CPU paged decode kernel alone: time per cached key and query head.

``--seqs`` decode rows (sequences) over a context of ``--context`` keys each, their blocks
in a random order of the pool (as a serving pool scatters them), for a few head layouts (KV
heads, query heads, head_dim), on ``--threads`` threads; prints microseconds per call
(median of 7 series), nanoseconds per (key, query head) and the K/V bytes read per second.
The same pool is read call after call: K/V smaller than the L3 (one sequence of 2000 keys
is 4 MB) is read from cache, so only a batch larger than it (``--seqs 32 --context 550``:
36 MB) measures memory reads. ``--layers N`` gives each call its own pool, as a decode step
reads one per layer, and times a pass over the N in turn: ``--layers 8 --seqs 20 --context
450`` reads 74 MB of bfloat16 K/V a pass, the 33.6M model's decode step at 20 sequences,
from memory.

    python benchmarks/attention_kernel.py --threads 1 --context 2000
    python benchmarks/attention_kernel.py --threads 2 --seqs 32 --context 550
    python benchmarks/attention_kernel.py --threads 2 --seqs 20 --context 450 --layers 8 \
        --dtype bfloat16 --layouts 4,8,64
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from pagectl.engine.attention import cpu_build  # noqa: E402

LAYOUTS = [(4, 8, 64), (1, 1, 64), (4, 8, 16), (4, 8, 128)]  # kv heads, q heads, head_dim


def one_pass(ops, caches, q, tables, lens, scale, out) -> None:
    """One decode call per pool, in turn (a step's layers)."""
    for cache in caches:
        ops.paged_decode(q, cache, tables, lens, scale, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--layers", type=int, default=1, help="pools read in turn (one per layer)")
    ap.add_argument(
        "--layouts",
        default=";".join(",".join(map(str, x)) for x in LAYOUTS),
        help="kv heads,q heads,head_dim; ... (default: all four)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_build.load_cpu_ops()
    if ops is None:
        raise SystemExit(f"the CPU kernel did not build: {cpu_build.failure_reason()}")
    dtype = getattr(torch, args.dtype)
    bs, n, seqs = 16, args.context, args.seqs
    print(
        f"threads {args.threads}, {seqs} sequences x {n} keys, {args.dtype}, load {os.getloadavg()}"
    )
    g = torch.Generator().manual_seed(0)
    layouts = [tuple(int(v) for v in item.split(",")) for item in args.layouts.split(";")]
    for kvh, nh, d in layouts:
        per_seq = -(-n // bs)
        blocks = seqs * per_seq + 1
        caches = [
            torch.randn(2, blocks, bs, kvh, d, generator=g).to(dtype) for _ in range(args.layers)
        ]
        order = torch.randperm(blocks - 1, generator=g).to(torch.int32)
        tables = order[: seqs * per_seq].view(seqs, per_seq).contiguous()
        q = torch.randn(seqs, nh, d, generator=g).to(dtype)
        out = torch.empty_like(q)
        lens = torch.full((seqs,), n, dtype=torch.int32)

        for _ in range(5):
            one_pass(ops, caches, q, tables, lens, d**-0.5, out)
        series = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                one_pass(ops, caches, q, tables, lens, d**-0.5, out)
            series.append((time.perf_counter() - t0) / args.calls / args.layers * 1e6)
        us = statistics.median(series)
        kv_bytes = 2 * seqs * n * kvh * d * caches[0].element_size()
        print(
            f"kv heads {kvh}, q heads {nh}, head_dim {d}: {us:.0f} us per call, "
            f"{us * 1e3 / (seqs * n * nh):.1f} ns per key and query head, "
            f"{kv_bytes / us / 1e3:.1f} GB/s of K/V"
            + (
                f" ({args.layers} pools in turn: {us * args.layers / 1e3:.2f} ms a pass)"
                if args.layers > 1
                else ""
            )
        )


if __name__ == "__main__":
    main()
