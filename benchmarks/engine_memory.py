"""Where the engine's memory goes over a long run: Python heap (tracemalloc) against RSS.

    python benchmarks/engine_memory.py --rounds 20 --requests 64
    python benchmarks/engine_memory.py --rounds 15 --requests 64 --library-defaults

Runs the engine in this process (the ``LLM`` class, tiny random-weight Qwen3 unless
``--model``) through ``--rounds`` rounds of ``--requests`` requests with prompt and output
lengths drawn at random, and after each round prints the process RSS, the Python heap that
tracemalloc sees, the number of live Python objects, and the KV blocks in use. A heap that
stays flat while RSS grows points at native memory (torch tensors of varying shapes, glibc
arenas) rather than a Python leak; a growing heap names its top allocation sites at the end.

The native side is broken down with glibc's ``mallinfo2`` (summed over every arena): bytes
malloc has handed out and not had back (``malloc_used``), bytes freed but kept in its heaps
(``malloc_free``), and big blocks it mmapped (``mmapped``). The engine process's bounds
(``pagectl.engine_process.native_memory.configure``) are applied before torch is imported,
as ``pagectl daemon`` does; ``--library-defaults`` leaves them out (what the engine did
before them; environment variables such as ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` still apply).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def malloc_stats(libc) -> dict:
    """glibc's heap figures in MB (all arenas): used, free but kept, mmapped."""
    libc.mallinfo2.restype = MallInfo2
    m = libc.mallinfo2()
    mb = 2**20
    return {
        "malloc_used_mb": round(m.uordblks / mb, 1),
        "malloc_free_mb": round(m.fordblks / mb, 1),
        "mmapped_mb": round(m.hblkhd / mb, 1),
    }


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
    ap.add_argument(
        "--library-defaults",
        action="store_true",
        help="run without the engine process's native-memory bounds (the libraries' defaults)",
    )
    ap.add_argument(
        "--no-heap",
        action="store_true",
        help="skip tracemalloc (faster; the py_heap column reads 0)",
    )
    args = ap.parse_args()
    applied = {}
    if not args.library_defaults:
        from pagectl.engine_process.native_memory import configure

        applied = configure()
    print(f"native bounds applied: {applied or 'none'}", flush=True)
    from pagectl.engine.llm import LLM
    from pagectl.engine.sampling_params import SamplingParams

    glibc = ctypes.CDLL("libc.so.6")
    libc = glibc if args.trim else None
    model = args.model
    if model is None:
        from tiny_models import build_tiny_model

        model = str(Path(tempfile.mkdtemp(prefix="pagectl-mem-")) / "tiny-qwen3")
        build_tiny_model(Path(model), "qwen3")
    llm = LLM(model, num_kv_blocks=256, max_model_len=512)
    rng = random.Random(args.seed)
    proc = psutil.Process()
    if not args.no_heap:
        tracemalloc.start(10)
    first = None
    rows = []
    print(
        "round  rss_mb  after_trim  py_heap_mb  py_objects  used_blocks  malloc_used  "
        "malloc_free  mmapped  round_s  trim_ms",
        flush=True,
    )
    for r in range(args.rounds):
        prompts = [
            [rng.randrange(3, 384) for _ in range(rng.randrange(4, 300))]
            for _ in range(args.requests)
        ]
        params = [
            SamplingParams(max_tokens=rng.randrange(1, 128), temperature=0.8, ignore_eos=True)
            for _ in prompts
        ]
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        took = time.perf_counter() - t0
        gc.collect()
        heap, _ = tracemalloc.get_traced_memory()
        rss = proc.memory_info().rss
        trim_s = 0.0
        if libc is not None:
            t1 = time.perf_counter()
            libc.malloc_trim(0)
            trim_s = time.perf_counter() - t1
        row = {
            "round": r,
            "rss_mb": round(rss / 2**20, 1),
            "rss_after_trim_mb": round(proc.memory_info().rss / 2**20, 1) if libc else None,
            "py_heap_mb": round(heap / 2**20, 2),
            "py_objects": len(gc.get_objects()),
            "used_blocks": llm.core.scheduler.kv.pool.num_used_blocks,
            **malloc_stats(glibc),
            "round_s": round(took, 2),
            "trim_ms": round(trim_s * 1000, 2) if libc else None,
        }
        rows.append(row)
        if r == 1 and not args.no_heap:
            first = tracemalloc.take_snapshot()
        print(
            f"{r:5d} {row['rss_mb']:7.1f} {row['rss_after_trim_mb'] or 0:11.1f} "
            f"{row['py_heap_mb']:11.2f} {row['py_objects']:11d} "
            f"{row['used_blocks']:12d} {row['malloc_used_mb']:12.1f} "
            f"{row['malloc_free_mb']:12.1f} {row['mmapped_mb']:8.1f} {took:8.2f} "
            f"{trim_s * 1000:8.2f}",
            flush=True,
        )
    if first is not None:
        top = tracemalloc.take_snapshot().compare_to(first, "lineno")[:5]
        print("largest heap growth since round 1:")
        for stat in top:
            print(f"  {stat}")
    print(json.dumps({"first": rows[0], "last": rows[-1], "native": applied}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
