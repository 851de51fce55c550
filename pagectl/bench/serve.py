"""``pagectl bench serve``: online serving with concurrent streaming clients.

Against a running daemon (``--url``) or one it starts (``--model`` / ``--synthetic-model`` and
engine flags). Requests come from the same random workload as ``bench throughput``: streaming
completions with token-id prompts, ``ignore_eos`` and each request's own ``max_tokens``.
Reports request/s, output tokens/s, TTFT, TPOT and ITL (p50, p90, p99).

In the same run, when ``transformers serve`` is installed, it is started with
``--continuous-batching`` on the same model directory and driven by the same clients. Its
completions endpoint takes text prompts only, so it gets each prompt decoded with the model's
tokenizer (for the synthetic models an exact round trip), EOS switched off through the
request's ``generation_config``, and its output tokens are counted from its usage chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import urllib.request
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
from pagectl.bench.stats import serving_metrics
from pagectl.bench.throughput import parse_peers
from pagectl.bench.workload import BenchRequest, random_workload

SERVE_PEERS = ("hf-serve",)
# Output tokens/s: pagectl >= 3x transformers serve, with a lower p50 TTFT.
TARGET_OUTPUT_RATIO = 3.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pagectl.engine.args import add_cli_arguments

    p.add_argument("--url", default=None, help="base URL of a running daemon (default: start one)")
    p.add_argument(
        "--api-key", default=os.environ.get("PAGECTL_API_KEY"), help="API key of the daemon"
    )
    p.add_argument("--concurrency", type=int, default=16, help="streaming clients in flight")
    p.add_argument("--request-timeout", type=float, default=900.0, help="seconds per request")
    p.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds for a server to get ready"
    )
    p.add_argument(
        "--daemon-arg",
        action="append",
        default=[],
        help="extra flag for a started daemon (repeatable)",
    )
    p.add_argument(
        "--peers",
        default=",".join(SERVE_PEERS),
        help="peers to run: hf-serve (transformers serve --continuous-batching) or none",
    )
    p.add_argument(
        "--hf-max-batch-tokens", type=int, default=None, help="transformers serve token budget"
    )
    p.add_argument(
        "--hf-page-size", type=int, default=256, help="page size of transformers' paged cache"
    )
    p.add_argument(
        "--hf-serve-pythonpath",
        default=None,
        help="directory prepended to PYTHONPATH for transformers serve only (its serving extras)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    add_cli_arguments(p)
    add_model_arguments(p)
    add_workload_arguments(p)


def engine_flags(args: argparse.Namespace) -> list[str]:
    """Daemon flags for the engine options that differ from their defaults."""
    from pagectl.engine.args import add_cli_arguments

    ref = argparse.ArgumentParser(add_help=False)
    add_cli_arguments(ref)
    flags: list[str] = []
    # Each flag is spelled as the parser declares it (argparse lists its actions only here).
    for action in ref._actions:
        value = getattr(args, action.dest, action.default)
        if action.dest == "model" or value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            flags.append(action.option_strings[0 if value else 1])  # --x / --no-x
        elif action.nargs == 0:  # store_true
            flags.append(action.option_strings[0])
        else:
            flags += [action.option_strings[0], str(value)]
    return flags


def pagectl_payloads(
    model_name: str, workload: list[BenchRequest], temperature: float
) -> list[dict]:
    return [
        {
            "model": model_name,
            "prompt": r.prompt_token_ids,
            "max_tokens": r.output_len,
            "temperature": temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for r in workload
    ]


def transformers_payloads(
    model: str, prompts: list[str], workload: list[BenchRequest], temperature: float
) -> list[dict]:
    # eos_token_id None in the request's generation config: EOS never ends a request.
    gen = json.dumps({"do_sample": temperature > 0, "eos_token_id": None})
    return [
        {
            "model": model,
            "prompt": text,
            "max_tokens": r.output_len,
            "temperature": temperature,
            "stream": True,
            "generation_config": gen,
        }
        for text, r in zip(prompts, workload, strict=True)
    ]


def served_model_name(base_url: str, headers: dict, fallback: str) -> str:
    req = urllib.request.Request(base_url + "/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            data = json.loads(r.read())
        return data["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        return fallback


def drive(
    base_url: str, payloads: list[dict], concurrency: int, headers: dict, timeout_s: float
) -> dict:
    """Warm up with one short request, then run every payload; returns the metrics.

    A server whose warm-up request fails is reported as skipped, with the error.
    """
    from pagectl.bench.client import run_clients

    url = base_url + "/v1/completions"
    warm = dict(payloads[0], max_tokens=2)
    done, _ = asyncio.run(run_clients(url, [warm], 1, headers=headers, request_timeout_s=timeout_s))
    if not done or not done[0].ok:
        return {"skipped": f"warm-up request failed: {done[0].error if done else 'no answer'}"}
    timings, duration = asyncio.run(
        run_clients(url, payloads, concurrency, headers=headers, request_timeout_s=timeout_s)
    )
    metrics = serving_metrics(timings, duration)
    errors = [t.error for t in timings if t.error]
    if errors:
        metrics["first_error"] = errors[0]
    return metrics


def run(args: argparse.Namespace) -> int:
    try:
        peers = parse_peers(args.peers, SERVE_PEERS)
    except ValueError as e:
        print(f"pagectl bench serve: {e}", file=sys.stderr)
        return 2
    from pagectl.bench import servers

    if args.url and args.model is None and args.synthetic_model is None:
        print(
            "pagectl bench serve: with --url, name the served model's directory (--model or "
            "--synthetic-model) so the workload uses its vocabulary",
            file=sys.stderr,
        )
        return 2
    model = resolve_model(args)
    try:  # before a daemon is started, which a bad workload would leave running
        spec = workload_spec(args, model_vocab_size(model))
    except ValueError as e:
        print(f"pagectl bench serve: {e}", file=sys.stderr)
        return 2
    workload = random_workload(spec)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    results: dict[str, Any] = {}
    started = None
    if args.url:
        base = args.url.rstrip("/")
    else:
        log(f"starting pagectl daemon on {model} ...")
        started = servers.start_daemon(model, engine_flags(args) + list(args.daemon_arg))
        base = started.base_url
    try:
        if started is not None:
            started.wait_ready(args.startup_timeout)
        name = served_model_name(base, headers, model)
        log(f"pagectl: {len(workload)} requests, concurrency {args.concurrency} ...")
        results["pagectl"] = drive(
            base,
            pagectl_payloads(name, workload, args.temperature),
            args.concurrency,
            headers,
            args.request_timeout,
        )
    finally:
        if started is not None:
            started.stop()
    if "hf-serve" in peers:
        results["hf-serve"] = _run_transformers_serve(args, model, workload)

    report = {
        "benchmark": "serve",
        "model": model,
        "concurrency": args.concurrency,
        "workload": asdict(spec),
        "machine": machine_info(),
        "results": results,
    }
    report["targets"] = serve_targets(results)
    print(render(report))
    if args.json:
        print(dumps(report))
    return 0


def _run_transformers_serve(
    args: argparse.Namespace, model: str, workload: list[BenchRequest]
) -> dict:
    from pagectl.bench import servers
    from pagectl.bench.peers import paged_cache_blocks

    why = servers.transformers_serve_available(args.hf_serve_pythonpath)
    if why is not None:
        log(f"transformers serve skipped: {why}")
        return {"skipped": why}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [str(tok.decode(r.prompt_token_ids)) for r in workload]
    log("starting transformers serve --continuous-batching ...")
    srv = servers.start_transformers_serve(
        model,
        num_blocks=paged_cache_blocks(workload, args.hf_page_size),
        max_batch_tokens=hf_token_budget(args),
        extra_pythonpath=args.hf_serve_pythonpath,
    )
    try:
        srv.wait_ready(args.startup_timeout)
        log(f"transformers serve: {len(workload)} requests, concurrency {args.concurrency} ...")
        payloads = transformers_payloads(model, prompts, workload, args.temperature)
        return drive(srv.base_url, payloads, args.concurrency, {}, args.request_timeout)
    except RuntimeError as e:
        return {"skipped": str(e)}
    finally:
        srv.stop()


def serve_targets(results: dict) -> dict:
    def measured(m: dict | None) -> dict:
        # A server with no completed request has no figures to compare.
        return m if m and m.get("completed") else {}

    pc = measured(results.get("pagectl"))
    hf = measured(results.get("hf-serve"))
    out_ratio = ratio(pc.get("output_throughput"), hf.get("output_throughput"))
    ttft_pc = (pc.get("ttft_ms") or {}).get("p50")
    ttft_hf = (hf.get("ttft_ms") or {}).get("p50")
    return {
        "output_throughput_ratio": out_ratio,
        "output_throughput_met": None if out_ratio is None else out_ratio >= TARGET_OUTPUT_RATIO,
        "ttft_p50_lower": None if ttft_pc is None or ttft_hf is None else ttft_pc < ttft_hf,
    }


LABELS = {"pagectl": "pagectl daemon", "hf-serve": "transformers serve --continuous-batching"}


def render(report: dict) -> str:
    rows, lat, notes = [], [], []
    for key, m in report["results"].items():
        label = LABELS.get(key, key)
        if "skipped" in m:
            rows.append([label, "-", "-", "-", "-", "skipped"])
            notes.append(f"{label} skipped: {m['skipped']}")
            continue
        rows.append(
            [
                label,
                m["completed"],
                m["failed"],
                m["duration_s"],
                m["request_throughput"],
                m["output_throughput"],
            ]
        )
        if m.get("first_error"):
            notes.append(f"{label}: first error: {m['first_error']}")
        lat.append(
            [label]
            + [m[k][p] for k in ("ttft_ms", "tpot_ms", "itl_ms") for p in ("p50", "p90", "p99")]
        )
    spec = report["workload"]
    head = (
        f"model: {report['model']}\nworkload: {spec['num_requests']} requests, prompts "
        f"{spec['min_input_len']}-{spec['max_input_len']}, outputs {spec['min_output_len']}-"
        f"{spec['max_output_len']}, concurrency {report['concurrency']}"
    )
    t1 = format_table(["server", "ok", "failed", "time s", "req/s", "output tok/s"], rows)
    t2 = format_table(
        ["latency ms", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99", "ITL p50", "p90", "p99"],
        lat,
    )
    t = report["targets"]
    met = {None: "pending", True: "met", False: "NOT met"}
    tail = (
        f"output tok/s, pagectl / transformers serve: {fmt_ratio(t['output_throughput_ratio'])} "
        f"(target >= {TARGET_OUTPUT_RATIO:g}x: {met[t['output_throughput_met']]}); "
        f"lower p50 TTFT: {met[t['ttft_p50_lower']]}"
    )
    return "\n".join([head, t1, *notes, "", t2, tail])
