"""Which matmul kernel is fastest for a decode-sized and a batch-sized step on this CPU.

For the shapes of the standard models' projections and LM head, times ``x @ W^T`` with:
float32 in oneDNN's packed layout (pagectl's float path), float32 ``F.linear``, bfloat16
``F.linear``, ``torch._weight_int8pack_mm`` with float32 and bfloat16 activations, and
``torch._weight_int4pack_mm_for_cpu`` (group 128) with float32 and bfloat16 activations.
Each figure is the median of 5 runs of 20 calls, the kernels interleaved so a drifting load
hits them alike; ms per call.

    python benchmarks/quant_kernels.py --threads 2
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pagectl.engine.models.linear import pack_cpu_weight, packed_linear  # noqa: E402
from pagectl.engine.quant.kernels import Int4Weight, Int8Weight  # noqa: E402

# (label, N, K): Qwen3 33.6M gate_up and down, Qwen3-0.6B gate_up, down and LM head.
SHAPES = [
    ("33m gate_up", 3072, 512),
    ("33m down", 512, 1536),
    ("0.6b gate_up", 6144, 1024),
    ("0.6b down", 1024, 3072),
    ("0.6b lm_head", 151936, 1024),
]


def _time(fn, calls: int = 20) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def _kernels(x, w, packed, q8, q4) -> dict:
    xb, wb = x.bfloat16(), w.bfloat16()
    fns = {
        "f32 packed": (lambda: packed_linear(x, packed)) if packed is not None else None,
        "f32": lambda: F.linear(x, w),
        "bf16": lambda: F.linear(xb, wb),
        "int8 f32-act": lambda: torch._weight_int8pack_mm(x, q8.plain(), q8.scale.float()),
        "int8 bf16-act": lambda: q8.matmul(x),
        "int4 f32-act": lambda: torch._weight_int4pack_mm_for_cpu(
            x, q4.packed, 128, q4.scales_and_zeros.float()
        ),
        "int4 bf16-act": lambda: q4.matmul(x),
    }
    return {k: f for k, f in fns.items() if f is not None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,16", help="activation rows (tokens per step)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {os.getloadavg()}")
    for label, n, k in SHAPES:
        w = torch.randn(n, k) * 0.05
        packed = pack_cpu_weight(w)
        q8 = Int8Weight.quantize(w)
        q4 = Int4Weight.quantize(w, 128)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            fns = _kernels(x, w, packed, q8, q4)
            for f in fns.values():
                f()
            runs: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(5):
                for name, f in fns.items():
                    runs[name].append(_time(f))
            cells = ", ".join(f"{name} {statistics.median(v):.3f}" for name, v in runs.items())
            print(f"{label} [{n}x{k}] rows {m}: {cells}", flush=True)


if __name__ == "__main__":
    main()
