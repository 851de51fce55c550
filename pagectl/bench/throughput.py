"""``pagectl bench throughput``: offline throughput through the LLM API, beside its peers.

In one run, on the same model, workload and threads: pagectl (``LLM.generate`` with each
request's own ``max_tokens``), transformers continuous batching, transformers ``generate`` in
static padded batches, and the forward-pass limit. Prints useful output tokens/s and the
ratios against the targets; ``--json`` adds one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from pagectl.bench.options import (
    add_model_arguments,
    add_workload_arguments,
    hf_token_budget,
    log,
    model_vocab_size,
    resolve_model,
    workload_spec,
)
from pagectl.bench.report import dumps, fmt_ratio, format_table, machine_info, ratio
from pagectl.bench.results import EngineResult, count_useful
from pagectl.bench.workload import (
    BenchRequest,
    WorkloadSpec,
    random_workload,
    total_output_tokens,
)

PEERS = ("hf-cb", "hf-static", "forward")
# Minimum pagectl / peer ratios the project aims for (see docs/PERFORMANCE.md).
TARGETS = {"hf-cb": 5.0, "hf-static": 4.0, "forward": 0.6}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pagectl.engine.args import add_cli_arguments

    add_cli_arguments(p)
    add_model_arguments(p)
    add_workload_arguments(p)
    g = p.add_argument_group("peers")
    g.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"comma-separated peers to run, from {', '.join(PEERS)}; 'none' for pagectl alone",
    )
    g.add_argument("--no-pagectl", action="store_true", help="run the peers only")
    g.add_argument(
        "--hf-batch-size", type=int, default=16, help="static batch size of transformers generate"
    )
    g.add_argument(
        "--hf-max-batch-tokens",
        type=int,
        default=None,
        help="token budget per step of transformers continuous batching (default: pagectl's budget, or 2048)",
    )
    g.add_argument(
        "--hf-page-size", type=int, default=256, help="page size of transformers' paged cache"
    )
    g.add_argument(
        "--forward-seq-len",
        type=int,
        default=512,
        help="sequence length of the forward-limit probe",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="split pagectl's run into step phases and print the functions with the most own time",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def parse_peers(value: str, known: Sequence[str] = PEERS) -> list[str]:
    """The comma-separated ``--peers`` value as a list; "none" (or nothing) is no peer."""
    if value.strip().lower() in ("", "none"):
        return []
    peers = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in peers if v not in known]
    if bad:
        raise ValueError(f"unknown peer(s) {', '.join(bad)}; choose from {', '.join(known)}")
    return peers


def run_pagectl(
    llm: Any, workload: list[BenchRequest], temperature: float = 0.0, profile: bool = False
) -> EngineResult:
    """Time ``llm.generate`` on the whole workload, one ``SamplingParams`` per request.

    With ``profile``, the run is also split into engine-step phases and profiled with
    cProfile (``extra["profile"]``); both add a little overhead to the figure.
    """
    from pagectl.engine.sampling_params import SamplingParams

    res = EngineResult("pagectl", "pagectl (LLM.generate)", len(workload))
    params = [
        SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=temperature, seed=i)
        for i, r in enumerate(workload)
    ]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    # Warm-up, not timed: first-call costs (allocations, kernels) out of the figure.
    llm.generate(
        {"prompt_token_ids": [1, 2, 3, 4]},
        SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0),
    )
    counters = _engine_counters(llm)
    from pagectl.bench.profile import ModelTokenCounter, PhaseTimer, top_functions

    with contextlib.ExitStack() as stack:
        fed = stack.enter_context(ModelTokenCounter(llm))
        if profile:
            import cProfile

            phases = stack.enter_context(PhaseTimer(llm))
            prof = stack.enter_context(cProfile.Profile())
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        res.elapsed_s = time.perf_counter() - t0
    res.model_tokens = fed.tokens
    after = _engine_counters(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    res.useful_output_tokens, res.num_length_mismatches = count_useful(
        tokens, [r.output_len for r in workload]
    )
    res.extra = {k: after[k] - counters.get(k, 0) for k in after}
    if profile:
        res.extra["profile"] = {
            "phases_s": phases.breakdown(res.elapsed_s),
            "top_functions": top_functions(prof, 25),
        }
    return res


def _engine_counters(llm: Any) -> dict[str, int]:
    """Scheduler counters (steps, prompt tokens computed, preemptions), when reachable."""
    try:
        c = llm.core.counters
    except AttributeError:
        return {}
    return {
        "steps": c.steps,
        "prompt_tokens_computed": c.prompt_tokens,
        "generation_tokens": c.generation_tokens,
        "preemptions": c.preemptions,
    }


def build_report(
    spec: WorkloadSpec, model: str, results: list[EngineResult], extra: dict | None = None
) -> dict:
    """The JSON report: workload, machine, each engine's result, ratios and targets."""
    by_name = {r.name: r for r in results}
    pc = by_name.get("pagectl")
    pc_useful = pc.tokens_per_s if pc else None
    pc_model = pc.model_tokens_per_s if pc else None
    ratios = {}
    targets = {}
    for name, goal in TARGETS.items():
        peer = by_name.get(name)
        peer_rate = peer.tokens_per_s if peer else None
        if name == "forward":
            # Engine efficiency: positions through the model per second against the bare
            # forward's rate (useful output alone cannot reach it: prompts cost forwards too).
            r = ratio(pc_model, peer_rate)
            ratios["pagectl_useful/forward"] = ratio(pc_useful, peer_rate)
            # The stricter limit: the same forward with logits for the last position only.
            last = peer.extra.get("last_logits_tokens_per_s") if peer else None
            ratios["pagectl/forward_last_logits"] = ratio(pc_model, last)
        else:
            r = ratio(pc_useful, peer_rate)
        ratios[f"pagectl/{name}"] = r
        targets[f"pagectl/{name}"] = {"target": goal, "met": None if r is None else r >= goal}
    return {
        "benchmark": "throughput",
        "model": model,
        "workload": asdict(spec),
        "machine": machine_info(),
        "results": {r.name: r.to_dict() for r in results},
        "ratios": ratios,
        "targets": targets,
        **(extra or {}),
    }


def render_table(results: list[EngineResult]) -> str:
    """One row per engine. The forward row's ratio compares model tok/s (engine efficiency)."""
    pc = next((r for r in results if r.name == "pagectl"), None)
    rows: list[list[Any]] = []
    for r in results:
        if r.error is not None:
            rows.append([r.label, "-", "-", "-", "-", "-", "skipped"])
            continue
        if r.name == "forward":
            rel = ratio(pc.model_tokens_per_s, r.tokens_per_s) if pc is not None else None
            rows.append([r.label, "-", "-", "-", "-", r.tokens_per_s, fmt_ratio(rel)])
            continue
        rel = ratio(pc.tokens_per_s, r.tokens_per_s) if pc is not None and r is not pc else None
        rows.append(
            [
                r.label,
                r.num_requests,
                r.useful_output_tokens,
                r.elapsed_s,
                r.tokens_per_s,
                r.model_tokens_per_s,
                fmt_ratio(rel),
            ]
        )
    headers = ["engine", "requests", "useful tokens", "time s", "useful tok/s", "model tok/s"]
    headers.append("pagectl / this")
    notes = [f"{r.label} skipped: {r.error}" for r in results if r.error is not None]
    notes.append(
        "model tok/s: token positions through the forward passes (prompts, decode inputs, padding)"
    )
    return "\n".join([format_table(headers, rows), *notes])


def render_targets(report: dict) -> str:
    names = {
        "hf-cb": "transformers continuous batching",
        "hf-static": "static batches",
        "forward": "forward limit",
    }
    lines = []
    for key, t in report["targets"].items():
        r = report["ratios"][key]
        peer = key.split("/", 1)[1]
        state = "pending" if t["met"] is None else ("met" if t["met"] else "NOT met")
        unit = "model tok/s" if peer == "forward" else "useful tok/s"
        lines.append(
            f"pagectl / {names[peer]} ({unit}): {fmt_ratio(r)} (target >= {t['target']:g}x: {state})"
        )
        if peer == "forward" and report["ratios"].get("pagectl/forward_last_logits") is not None:
            fwd = report["results"]["forward"]["extra"]
            lines.append(
                "  stricter limit, the same forward with last-position logits only: "
                f"{fwd['last_logits_tokens_per_s']:.1f} tok/s; pagectl / that (model tok/s): "
                f"{fmt_ratio(report['ratios']['pagectl/forward_last_logits'])}"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        peers = parse_peers(args.peers)
    except ValueError as e:
        print(f"pagectl bench throughput: {e}", file=sys.stderr)
        return 2
    import torch

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model = resolve_model(args)
    try:
        spec = workload_spec(args, model_vocab_size(model))
    except ValueError as e:
        print(f"pagectl bench throughput: {e}", file=sys.stderr)
        return 2
    workload = random_workload(spec)
    log(
        f"model {model}; {len(workload)} requests, {total_output_tokens(workload)} output tokens; "
        f"torch threads {torch.get_num_threads()}"
    )
    results: list[EngineResult] = []

    if not args.no_pagectl:
        results.append(_run_pagectl_engine(args, model, workload))
    hf_model = None
    if peers:
        from pagectl.bench.peers import load_hf_model

        hf_model = load_hf_model(model, "float32" if args.dtype == "auto" else args.dtype)
    # Forward limit and static batches before continuous batching, which swaps the model's
    # attention implementation while it runs.
    for peer in [p for p in ("forward", "hf-static", "hf-cb") if p in peers]:
        results.append(_run_peer(peer, hf_model, workload, args))
    del hf_model
    gc.collect()

    report = build_report(spec, model, results, {"torch_threads": torch.get_num_threads()})
    print(format_header(spec, model, torch.get_num_threads()))
    print(render_table(results))
    print(render_targets(report))
    pc = next((r for r in results if r.name == "pagectl" and r.error is None), None)
    prof = pc.extra.get("profile") if pc else None
    if pc and prof:
        from pagectl.bench.profile import render_breakdown

        print("\npagectl time by step phase (cProfile on; the rest is the offline loop):")
        print(render_breakdown(prof["phases_s"], pc.extra.get("steps", 0)))
        print("\nfunctions with the most own time:")
        print(prof["top_functions"])
    if args.json:
        print(dumps(report))
    return 0


def format_header(spec: WorkloadSpec, model: str, threads: int) -> str:
    return (
        f"model: {model}\nworkload: {spec.num_requests} requests, prompts {spec.min_input_len}-"
        f"{spec.max_input_len} tokens, outputs {spec.min_output_len}-{spec.max_output_len} tokens, "
        f"seed {spec.seed}, ignore_eos; torch threads: {threads}"
    )


def _run_pagectl_engine(
    args: argparse.Namespace, model: str, workload: list[BenchRequest]
) -> EngineResult:
    from pagectl.engine.args import EngineArgs

    engine_args = EngineArgs.from_cli(args, model=model)
    try:
        from pagectl.engine.llm import LLM

        log("pagectl: building the engine ...")
        with LLM.from_engine_args(engine_args) as llm:
            log("pagectl: running ...")
            res = run_pagectl(llm, workload, args.temperature, profile=args.profile)
    except (ImportError, ModuleNotFoundError) as e:
        return EngineResult(
            "pagectl", "pagectl (LLM.generate)", len(workload), error=f"engine unavailable: {e}"
        )
    log(f"pagectl: {res.tokens_per_s:.1f} useful tok/s")
    return res


def _run_peer(
    peer: str, model: Any, workload: list[BenchRequest], args: argparse.Namespace
) -> EngineResult:
    from pagectl.bench import peers as hf

    log(f"{peer}: running ...")
    try:
        if peer == "forward":
            res = hf.forward_limit(model, args.forward_seq_len)
        elif peer == "hf-static":
            res = hf.run_hf_static_batches(
                model, workload, batch_size=args.hf_batch_size, temperature=args.temperature
            )
        else:
            res = hf.run_hf_continuous_batching(
                model,
                workload,
                temperature=args.temperature,
                max_batch_tokens=hf_token_budget(args),
                page_size=args.hf_page_size,
            )
    except Exception as e:  # a peer that breaks is reported, not fatal to the comparison
        return EngineResult(peer, peer, len(workload), error=f"{type(e).__name__}: {e}")
    tps = res.tokens_per_s
    log(f"{peer}: {tps:.1f} tok/s" if tps is not None else f"{peer}: {res.error}")
    return res
