"""The CPU prefill attention kernel against torch's SDPA, one prompt at a time.

For each prompt length in ``--lengths`` (and ``--context`` cached keys before it), times the
CPU backend's prefill path (``CpuKernelPagedAttention.attend_prefills``: with context, the
sequence's keys and values gathered from its blocks, then
``torch.ops.pagectl_cpu.prefill_attention``) and the torch backend's
(``TorchPagedAttention.attend_prefills``: the same gather, then SDPA, causal, GQA) on the
same q, k, v and cache, alternating the two within each series; prints the median ms per call of ``--series`` series and the
kernel's speed against SDPA. The backend uses the kernel only where
``prefill_attention_fast()`` says this build should (``cpu_kernel.py``); this script times
it whatever that says, so a build can be checked before it is switched on.

    python benchmarks/prefill_attention.py --threads 2 --lengths 64,288,512
    python benchmarks/prefill_attention.py --threads 2 --dtype bfloat16 --context 256
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from pagectl.engine.attention import cpu_build  # noqa: E402
from pagectl.engine.attention.cpu_kernel import CpuKernelPagedAttention  # noqa: E402
from pagectl.engine.attention.torch_paged import PrefillSeq, TorchPagedAttention  # noqa: E402

BLOCK = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default="64,288,512")
    ap.add_argument("--context", type=int, default=0, help="cached keys before the prompt")
    ap.add_argument("--heads", default="8,4,64", help="query heads, KV heads, head_dim")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--calls", type=int, default=10, help="calls per series")
    ap.add_argument("--series", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_build.load_cpu_ops()
    if ops is None:
        raise SystemExit("the CPU kernels did not build")
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, dim = (int(x) for x in args.heads.split(","))
    scale = dim**-0.5
    fast = int(ops.prefill_attention_fast())
    # Every prefill on the kernel, whatever prefill_attention_fast() says.
    backend = CpuKernelPagedAttention(torch.device("cpu"), ops, prefill_rule=2)
    print(
        f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
        f"threads {args.threads}, {args.dtype}, heads {heads}/{kv_heads}, head_dim {dim}, "
        f"context {args.context}; prefill_attention_fast() = {fast}; load {os.getloadavg()}"
    )
    g = torch.Generator().manual_seed(0)
    for length in (int(x) for x in args.lengths.split(",")):
        seq_len = args.context + length
        q = torch.randn(length, heads, dim, generator=g).to(dtype)
        k_all = torch.randn(seq_len, kv_heads, dim, generator=g).to(dtype)
        v_all = torch.randn(seq_len, kv_heads, dim, generator=g).to(dtype)
        nblocks = (seq_len + BLOCK - 1) // BLOCK
        cache = torch.zeros(2, nblocks * BLOCK, kv_heads, dim, dtype=dtype)
        cache[0, :seq_len], cache[1, :seq_len] = k_all, v_all
        kv_cache = cache.view(2, nblocks, BLOCK, kv_heads, dim)
        if args.context:
            rows = torch.arange(length)[:, None] + args.context
            seq = PrefillSeq(
                0,
                length,
                seq_len,
                args.context,
                torch.arange(nblocks),
                torch.arange(seq_len)[None, :] <= rows,
            )
        else:
            seq = PrefillSeq(0, length, seq_len, 0, None, None)
        k_new, v_new = k_all[args.context :], v_all[args.context :]
        out_k = torch.empty_like(q)
        out_s = torch.empty_like(q)

        args_of = (q, k_new, v_new, kv_cache, [seq], scale)
        kernel = functools.partial(backend.attend_prefills, *args_of, out_k)
        sdpa = functools.partial(TorchPagedAttention.attend_prefills, *args_of, out_s)
        kernel()
        sdpa()
        err = (out_k.float() - out_s.float()).abs().max().item()
        times: dict[str, list[float]] = {"kernel": [], "sdpa": []}
        for _ in range(args.series):
            for name, fn in (("kernel", kernel), ("sdpa", sdpa)):
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                times[name].append((time.perf_counter() - t0) / args.calls * 1e3)
        tk, ts = statistics.median(times["kernel"]), statistics.median(times["sdpa"])
        print(
            f"{length} rows: kernel {tk:.3f} ms, SDPA {ts:.3f} ms, kernel {ts / tk:.2f}x "
            f"SDPA (max |diff| {err:.2e})"
        )


if __name__ == "__main__":
    main()
