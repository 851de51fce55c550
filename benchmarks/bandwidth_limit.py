"""The memory limit of single-stream decode: measured tok/s against bandwidth / weight bytes.

A decode step of one sequence reads every matmul weight once (the KV cache and activations
are small beside it at short contexts), so its speed is at most ``read bandwidth / weight
bytes per token``. This probe measures the machine's read bandwidth (the best of repeated
``sum`` over a tensor much larger than the caches, with the same torch threads as the engine),
then for each weight format (float32, bfloat16, load-time int8 and int4) builds the engine,
counts the bytes of the weights one token reads (projections and LM head, in the layout the
kernels read), and times single-stream greedy decode (one request, ``ignore_eos``; the time
per token after the first), printing tok/s, the limit and the fraction of it reached. The
probe runs again before and after every decode run, and each run is held against its own
probes (the median of the runs' fractions is printed): the host's bandwidth drifts.

    python benchmarks/bandwidth_limit.py --synthetic-model qwen3-33m --threads 2
    python benchmarks/bandwidth_limit.py --synthetic-model qwen3-0.6b --threads 2 --tokens 32
"""

from __future__ import annotations

import os

# Waiting OpenMP threads sleep instead of spinning (a shared machine; see runner_profile.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from pagectl.engine.args import EngineArgs  # noqa: E402
from pagectl.engine.builder import build_engine  # noqa: E402
from pagectl.engine.models.linear import PackableLinear  # noqa: E402
from pagectl.engine.sampling_params import SamplingParams  # noqa: E402

# name -> EngineArgs fields
FORMATS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "int8": dict(dtype="float32", quantization="int8"),
    "int4": dict(dtype="float32", quantization="int4"),
}


def read_bandwidth(gib: float = 1.0, repeats: int = 7, t: torch.Tensor | None = None) -> float:
    """Bytes/s of ``t.sum()`` over a ``gib`` GiB float32 tensor (best of ``repeats``)."""
    if t is None:
        t = torch.ones(int(gib * 2**30) // 4)
    t.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        t.sum()
        best = min(best, time.perf_counter() - t0)
    return t.numel() * 4 / best


def weight_bytes_per_token(model) -> int:
    """Bytes of matmul weights one decode token reads, as stored for their kernels."""
    total = 0
    for m in model.modules():
        if not isinstance(m, PackableLinear):
            continue
        if m.quantized is not None:
            total += m.quantized.nbytes()
        elif m._packed is not None:
            total += m._packed.numel() * m._packed.element_size()
        elif m._own_packed is not None:
            total += m._own_packed.numel() * m._own_packed.element_size()
        else:
            total += m.weight.numel() * m.weight.element_size()
    return total


def decode_tok_s(core, prompt_len: int, tokens: int, seed: int) -> float:
    """Single-stream decode tokens/s: the time per output token after the first."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 1000, (prompt_len,), generator=g).tolist()
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens)
    core.add_request(f"r{seed}", prompt, sp)
    stamps = []
    while core.has_unfinished():
        core.step()
        stamps.append(time.perf_counter())
    # stamps[0]: the prefill step (first token); each later step is one decode token.
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: a synthetic one)")
    p.add_argument("--synthetic-model", default="qwen3-33m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64, help="tokens per decode run")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="decode runs per format (median)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from pagectl.bench.synthetic import ensure_synthetic_model

        model = str(ensure_synthetic_model(args.synthetic_model))
    # The host's memory bandwidth moves within a minute (33-57 GB/s seen between two runs a
    # minute apart), so every decode run is bracketed by probes of the same 1 GiB tensor and
    # compared with the mean of its own two: a probe taken once would credit or blame the
    # kernel for the machine's drift.
    probe = torch.ones(2**30 // 4)
    print(f"model {model}; torch threads {torch.get_num_threads()}; load {os.getloadavg()}")
    print(
        f"read bandwidth: sum over 1 GiB float32, best of 3, before and after every run"
        f" ({read_bandwidth(t=probe, repeats=3) / 1e9:.2f} GB/s now)"
    )
    print(
        f"{'format':9} {'weights MB/token':>16} {'probe GB/s':>10} {'limit tok/s':>11}"
        f" {'tok/s':>8} {'of limit':>8}"
    )
    for name in args.formats.split(","):
        built = build_engine(EngineArgs(model=model, num_kv_blocks=64, **FORMATS[name]))
        runs = []  # (probe bytes/s around the run, tok/s)
        try:
            nbytes = weight_bytes_per_token(built.core.executor.model)
            decode_tok_s(built.core, 8, 4, seed=-1)  # warm-up
            for i in range(args.rounds):
                before = read_bandwidth(t=probe, repeats=3)
                rate = decode_tok_s(built.core, args.prompt_len, args.tokens, seed=i)
                after = read_bandwidth(t=probe, repeats=3)
                runs.append(((before + after) / 2, rate))
        finally:
            built.shutdown()
        fractions = [rate / (bw / nbytes) for bw, rate in runs]
        bw = statistics.median(b for b, _ in runs)
        rate = statistics.median(r for _, r in runs)
        print(
            f"{name:9} {nbytes / 1e6:16.1f} {bw / 1e9:10.2f} {bw / nbytes:11.1f} {rate:8.1f}"
            f" {statistics.median(fractions):8.0%}   (runs: "
            + ", ".join(
                f"{r:.1f} tok/s at {b / 1e9:.1f} GB/s = {f:.0%}"
                for (b, r), f in zip(runs, fractions)
            )
            + ")",
            flush=True,
        )


if __name__ == "__main__":
    main()
