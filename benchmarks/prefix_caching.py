"""Prefix caching: 64 requests sharing a 1024-token system prompt, caching on against off.

Each request is the same 1024-token system prompt followed by its own random suffix (16-64
tokens) and generates 32 tokens (greedy, ignore_eos). All requests are submitted at once to
a cold engine (nothing cached beforehand), through ``LLM.generate`` on the synthetic
benchmark model, once with prefix caching on and once off. Prefill tokens computed come
from the engine's counters (``scheduler.counters.prompt_tokens``: prompt tokens actually
fed to the model, cache hits excluded); throughput is requests/s and output tokens/s of the
timed ``generate`` call.

``--simulate`` runs the same workload through the scheduler and KV cache manager alone (no
model, no timing): the prefill token counts are the engine's, in a second.

Usage:
    python benchmarks/prefix_caching.py [--synthetic-model qwen3-33m | --model DIR] [--json]
    python benchmarks/prefix_caching.py --simulate
With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import time

from pagectl.bench.options import add_model_arguments, model_vocab_size, resolve_model
from pagectl.bench.report import dumps, format_table, machine_info
from pagectl.bench.workload import BenchRequest, shared_prefix_workload, total_prompt_tokens

TARGET_FEWER_PREFILL = 0.90
TARGET_SPEEDUP = 3.0


def run_engine(
    model: str, workload: list[BenchRequest], caching: bool, args: argparse.Namespace
) -> dict:
    from pagectl.engine.llm import LLM
    from pagectl.engine.sampling_params import SamplingParams

    kw = dict(
        model=model,
        dtype="float32",
        device="cpu",
        enable_prefix_caching=caching,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.num_threads,
    )
    with LLM(**kw) as llm:
        # Warm-up on an unrelated prompt: first-call costs out, nothing useful cached.
        llm.generate(
            [[3, 1, 4, 1, 5]], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
        )
        c = llm.core.scheduler.counters
        before = (c.prompt_tokens, c.prefix_hits)
        params = [
            SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
            for r in workload
        ]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in workload], params)
        elapsed = time.perf_counter() - t0
        prefill = c.prompt_tokens - before[0]
        hits = c.prefix_hits - before[1]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "prefix_caching": caching,
        "prompt_tokens": total_prompt_tokens(workload),
        "prefill_tokens_computed": prefill,
        "prefix_hit_tokens": hits,
        "cached_tokens_reported": sum(o.num_cached_tokens for o in outs),
        "elapsed_s": elapsed,
        "request_throughput": len(workload) / elapsed,
        "output_throughput": out_tokens / elapsed,
        "output_tokens": out_tokens,
    }


def run_simulated(workload: list[BenchRequest], caching: bool, budget: int) -> dict:
    from pagectl.bench.simulate import add_workload, blocks_for, make_scheduler, run_to_completion

    sched = make_scheduler(
        num_blocks=blocks_for(workload, 16) + 64,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
    )
    add_workload(sched, workload)
    steps = run_to_completion(sched)
    c = sched.counters
    return {
        "prefix_caching": caching,
        "prompt_tokens": total_prompt_tokens(workload),
        "prefill_tokens_computed": c.prompt_tokens,
        "prefix_hit_tokens": c.prefix_hits,
        "steps": steps,
    }


def summarize(on: dict, off: dict) -> dict:
    fewer = 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"]
    out = {"fewer_prefill_tokens": fewer, "fewer_prefill_met": fewer >= TARGET_FEWER_PREFILL}
    if "elapsed_s" in on and "elapsed_s" in off:
        speedup = off["elapsed_s"] / on["elapsed_s"]
        out.update(speedup=speedup, speedup_met=speedup >= TARGET_SPEEDUP)
    return out


def render(on: dict, off: dict, summary: dict, head: str) -> str:
    timed = "elapsed_s" in on
    rows = []
    for r in (off, on):
        row = [
            "on" if r["prefix_caching"] else "off",
            r["prompt_tokens"],
            r["prefill_tokens_computed"],
            r["prefix_hit_tokens"],
        ]
        if timed:
            row += [r["elapsed_s"], r["request_throughput"], r["output_throughput"]]
        rows.append(row)
    headers = ["prefix caching", "prompt tokens", "prefill computed", "cache hits"]
    if timed:
        headers += ["time s", "req/s", "output tok/s"]
    lines = [head, format_table(headers, rows)]
    met = {True: "met", False: "NOT met"}
    lines.append(
        f"prefill tokens: {100 * summary['fewer_prefill_tokens']:.1f}% fewer with caching "
        f"(target >= {100 * TARGET_FEWER_PREFILL:.0f}%: {met[summary['fewer_prefill_met']]})"
    )
    if timed:
        lines.append(
            f"throughput: {summary['speedup']:.2f}x with caching "
            f"(target >= {TARGET_SPEEDUP:g}x: {met[summary['speedup_met']]})"
        )
    else:
        lines.append("throughput: not measured (--simulate)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model directory (default: the synthetic model)")
    add_model_arguments(ap)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--min-suffix-len", type=int, default=16)
    ap.add_argument("--max-suffix-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument(
        "--simulate", action="store_true", help="scheduler only: prefill counts, no timing"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    vocab = 16384
    model = args.model
    if not args.simulate:
        model = resolve_model(args)
        vocab = model_vocab_size(model)
    workload = shared_prefix_workload(
        args.num_requests,
        args.prefix_len,
        args.min_suffix_len,
        args.max_suffix_len,
        args.output_len,
        vocab,
        args.seed,
    )
    if args.simulate:
        from pagectl.engine.args import EngineArgs

        # The engine runs on CPU in this benchmark: the CPU default budget.
        budget = EngineArgs(max_num_batched_tokens=args.max_num_batched_tokens).token_budget("cpu")
        off = run_simulated(workload, False, budget)
        on = run_simulated(workload, True, budget)
    else:
        off = run_engine(model, workload, False, args)
        on = run_engine(model, workload, True, args)
    summary = summarize(on, off)
    head = (
        f"model: {model or '(simulated: scheduler and KV manager only)'}\n"
        f"workload: {args.num_requests} requests = {args.prefix_len}-token shared prompt + "
        f"{args.min_suffix_len}-{args.max_suffix_len} own tokens, {args.output_len} output tokens, "
        "all submitted at once to a cold engine"
    )
    print(render(on, off, summary, head))
    if args.json:
        report = {
            "benchmark": "prefix_caching",
            "model": model,
            "simulated": args.simulate,
            "workload": {
                "num_requests": args.num_requests,
                "prefix_len": args.prefix_len,
                "suffix_len": [args.min_suffix_len, args.max_suffix_len],
                "output_len": args.output_len,
                "seed": args.seed,
            },
            "machine": machine_info(),
            "off": off,
            "on": on,
            "summary": summary,
        }
        print(dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
