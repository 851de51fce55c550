"""One pass over a standard model's decoder matmuls, per weight format and row count, on CPU.

Builds the projections of ``qwen3-33m`` or ``qwen3-0.6b`` (every layer's qkv, o, gate/up and
down, random weights; the LM head with ``--lm-head``) as the engine's own layers, stored as
the engine stores them after loading (``pack_for_cpu``: float32, bfloat16 and load-time int8
in the project kernel's packed layout on an AVX-512 CPU, else plain; int4 for torch's
kernel). For comparison: ``*-plain`` keeps the plain [N, K] layout for the project's plain
kernel, ``*-onednn`` moves float32 or bfloat16 into oneDNN's packed layout (the path without
the project's kernel; bfloat16 only where oneDNN takes it). It times
``layer(x)`` over all of them for ``M`` rows of x: the matmul time of a step of M tokens.
Prints ms per pass (median of ``--rounds``) and the weight bytes read per second. Whether
those bytes come from memory depends on the shape: the 0.6B shape's layers (0.44-1.76 GB)
are far larger than the caches; the 33.6M model's float32 layers (101 MB) are too, but its
int8 and int4 ones (25 and 13 MB) fit a 32 MiB L3, so there the figure is partly the cache's.

    python benchmarks/matmul_pass.py --model-shape qwen3-33m --rows 1,4,16,64,256,512
    python benchmarks/matmul_pass.py --model-shape qwen3-0.6b --rows 1,4,16,32,128,512 \
        --formats bfloat16,bfloat16-plain,bfloat16-onednn --rounds 3
    GOMP_SPINCOUNT=10000 python benchmarks/matmul_pass.py --rows 1,16

Formats interleave within each round so a drifting load hits them alike.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from pagectl.engine.models.linear import ColumnParallelLinear  # noqa: E402
from pagectl.engine.quant.kernels import Int8Weight  # noqa: E402

# (hidden, layers, q heads, kv heads, head_dim, intermediate, vocab)
SHAPES = {
    "qwen3-33m": (512, 8, 8, 4, 64, 1536, 16384),
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936),
}
FORMATS = (
    "float32",
    "float32-plain",
    "float32-onednn",
    "bfloat16",
    "bfloat16-plain",
    "bfloat16-onednn",
    "int8",
    "int8-plain",
    "int4",
)


def layer_shapes(name: str, lm_head: bool) -> list[tuple[int, int]]:
    """(N, K) of every matmul of one forward."""
    h, n_layers, nq, nkv, d, inter, vocab = SHAPES[name]
    per_layer = [((nq + 2 * nkv) * d, h), (h, nq * d), (2 * inter, h), (h, inter)]
    return per_layer * n_layers + ([(vocab, h)] if lm_head else [])


def build(shapes: list[tuple[int, int]], fmt: str, seed: int) -> list[ColumnParallelLinear]:
    g = torch.Generator().manual_seed(seed)
    layers = []
    for n, k in shapes:
        layer = ColumnParallelLinear(k, n, params_dtype=torch.float32)
        layer.weight.data.copy_(torch.randn(n, k, generator=g) / k**0.5)
        base, _, path = fmt.partition("-")
        if base in ("int8", "int4"):
            layer.quantize(base, 128)
            q = layer.quantized
            if path == "plain" and isinstance(q, Int8Weight) and q.is_packed:
                q.q, q.is_packed = q.plain().contiguous(), False
        elif base == "bfloat16":
            layer.weight.data = layer.weight.data.bfloat16()
        layer.pack_for_cpu(own_kernel=path != "onednn", packed_layout=path != "plain")
        layers.append(layer)
    return layers


def weight_bytes(layer: ColumnParallelLinear) -> int:
    q = layer.quantized
    if q is not None:
        return q.nbytes()
    packed = layer._packed if layer._packed is not None else layer._own_packed
    w = packed if packed is not None else layer.weight
    return w.numel() * w.element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-shape", choices=sorted(SHAPES), default="qwen3-33m")
    ap.add_argument("--rows", default="1,4,16,64,256,512")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lm-head", action="store_true", help="include the LM head")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = layer_shapes(args.model_shape, args.lm_head)
    formats = args.formats.split(",")
    built = {f: build(shapes, f, seed=0) for f in formats}
    nbytes = {f: sum(weight_bytes(x) for x in ls) for f, ls in built.items()}
    print(
        f"{args.model_shape}: {len(shapes)} matmuls; torch {torch.__version__}, "
        f"threads {args.threads}, load {os.getloadavg()}, "
        f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')}"
    )
    print("weight MB per pass: " + ", ".join(f"{f} {b / 1e6:.1f}" for f, b in nbytes.items()))
    k_max = max(k for _, k in shapes)
    for m in (int(r) for r in args.rows.split(",")):
        x32 = torch.randn(m, k_max)
        inputs = {
            dt: {k: x32[:, :k].contiguous().to(dt) for k in {k for _, k in shapes}}
            for dt in (torch.float32, torch.bfloat16)
        }
        times: dict[str, list[float]] = {f: [] for f in formats}
        for _ in range(args.rounds + 1):  # the first round warms up
            for f in formats:
                xs = inputs[torch.bfloat16 if f.startswith("bfloat16") else torch.float32]
                t0 = time.perf_counter()
                for layer, (_, k) in zip(built[f], shapes, strict=True):
                    layer(xs[k])
                times[f].append((time.perf_counter() - t0) * 1e3)
        cells = []
        for f in formats:
            ms = statistics.median(times[f][1:])
            cells.append(f"{f} {ms:.2f} ms ({nbytes[f] / ms / 1e6:.1f} GB/s)")
        print(f"M={m}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
