"""Where the engine's memory goes over a long run: Python heap (tracemalloc) against RSS.

    python benchmarks/engine_memory.py --rounds 20 --requests 64

Runs the engine in this process (the ``LLM`` class, tiny random-weight Qwen3 unless
``--model``) through ``--rounds`` rounds of ``--requests`` requests with prompt and output
lengths drawn at random, and after each round prints the process RSS, the Python heap that
tracemalloc sees, the number of live Python objects, and the KV blocks in use. A heap that
stays flat while RSS grows points at native memory (torch tensors of varying shapes, glibc
arenas) rather than a Python leak; a growing heap names its top allocation sites at the end.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import random
import sys
import tempfile
import tracemalloc
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from pagectl.engine.llm import LLM  # noqa: E402
from pagectl.engine.sampling_params import SamplingParams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--trim",
        action="store_true",
        help="call glibc malloc_trim(0) after each round and report RSS after it too "
        "(memory freed but kept by the allocator comes back)",
    )
    args = ap.parse_args()
    libc = ctypes.CDLL("libc.so.6") if args.trim else None
    model = args.model
    if model is None:
        from tiny_models import build_tiny_model

        model = str(Path(tempfile.mkdtemp(prefix="pagectl-mem-")) / "tiny-qwen3")
        build_tiny_model(Path(model), "qwen3")
    llm = LLM(model, num_kv_blocks=256, max_model_len=512)
    rng = random.Random(args.seed)
    proc = psutil.Process()
    tracemalloc.start(10)
    first = None
    rows = []
    print("round  rss_mb  after_trim  py_heap_mb  py_objects  used_blocks", flush=True)
    for r in range(args.rounds):
        prompts = [
            [rng.randrange(3, 384) for _ in range(rng.randrange(4, 300))]
            for _ in range(args.requests)
        ]
        params = [
            SamplingParams(max_tokens=rng.randrange(1, 128), temperature=0.8, ignore_eos=True)
            for _ in prompts
        ]
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        gc.collect()
        heap, _ = tracemalloc.get_traced_memory()
        rss = proc.memory_info().rss
        if libc is not None:
            libc.malloc_trim(0)
        row = {
            "round": r,
            "rss_mb": round(rss / 2**20, 1),
            "rss_after_trim_mb": round(proc.memory_info().rss / 2**20, 1) if libc else None,
            "py_heap_mb": round(heap / 2**20, 2),
            "py_objects": len(gc.get_objects()),
            "used_blocks": llm.core.scheduler.kv.pool.num_used_blocks,
        }
        rows.append(row)
        if r == 1:
            first = tracemalloc.take_snapshot()
        print(
            f"{r:5d} {row['rss_mb']:7.1f} {row['rss_after_trim_mb'] or 0:11.1f} "
            f"{row['py_heap_mb']:11.2f} {row['py_objects']:11d} "
            f"{row['used_blocks']:12d}",
            flush=True,
        )
    if first is not None:
        top = tracemalloc.take_snapshot().compare_to(first, "lineno")[:5]
        print("largest heap growth since round 1:")
        for stat in top:
            print(f"  {stat}")
    print(json.dumps({"first": rows[0], "last": rows[-1]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
