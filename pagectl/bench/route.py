"""``pagectl bench route``: prefix routing against round robin over two engines, in one run.

The same workload (``--system-prompts`` shared system prompts, each followed by ``--turns``
different user turns, in a seeded random order) runs, for each policy, against:

- ``route``: two daemons publishing KV-cache events behind a ``pagectl route`` router (in
  this process); both prefix caches are reset before each policy;
- ``dp``: one daemon with ``--data-parallel-size 2 --dp-routing POLICY`` (the policy is a
  start-up flag, so one daemon per policy, started after the previous one stopped).

Reported per target and policy: the prefix-cache hit rate over both engines (hit tokens /
looked-up tokens, from /metrics, summed over the ``engine`` label), output tok/s, and how
the requests were spread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import urllib.request

from pagectl.bench.client import run_clients
from pagectl.bench.servers import ServerProcess, _spawn, free_port
from pagectl.bench.stats import serving_metrics


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: the built-in)")
    p.add_argument("--daemon-arg", action="append", default=[], help="extra flag for both daemons")
    p.add_argument("--num-kv-blocks", type=int, default=96, help="KV blocks per daemon")
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--turns", type=int, default=8, help="user turns per system prompt")
    p.add_argument("--system-len", type=int, default=256, help="tokens per system prompt")
    p.add_argument("--user-len", type=int, default=32, help="tokens per user turn")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--policies", default="prefix,round_robin")
    p.add_argument(
        "--targets",
        default="route,dp",
        help="route: two daemons behind pagectl route; dp: one --data-parallel-size 2 daemon",
    )
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    systems = [
        [rng.randint(10, 250) for _ in range(args.system_len)] for _ in range(args.system_prompts)
    ]
    prompts = [
        s + [rng.randint(10, 250) for _ in range(args.user_len)]
        for _ in range(args.turns)
        for s in systems
    ]
    # Shuffled: in a fixed rotation, round robin would pin each system prompt to one
    # backend by accident.
    rng.shuffle(prompts)
    return prompts


_SERIES = re.compile(r"^(pagectl:[a-z_]+_total)(\{[^}]*\})? ([0-9.eE+-]+)$", re.M)
_ENGINE = re.compile(r'engine="(\d+)"')


def parse_totals(text: str) -> dict[str, float]:
    """Counter name -> its value summed over labels (the ``engine`` label among them)."""
    out: dict[str, float] = {}
    for k, _labels, v in _SERIES.findall(text):
        out[k] = out.get(k, 0.0) + float(v)
    return out


def scrape_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def scrape(url: str) -> dict[str, float]:
    return parse_totals(scrape_text(url))


def per_engine(text: str, name: str) -> dict[str, float]:
    """Engine label -> value of counter ``name`` (summed over its other labels)."""
    out: dict[str, float] = {}
    for k, labels, v in _SERIES.findall(text):
        m = _ENGINE.search(labels)
        if k == name and m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(v)
    return out


def delta(after: list[dict[str, float]], before: list[dict[str, float]], name: str) -> float:
    return sum(a.get(name, 0) - b.get(name, 0) for a, b in zip(after, before, strict=True))


async def run_policy(
    policy: str, specs: list[str], payloads: list[dict], concurrency: int
) -> tuple[dict, dict[str, int]]:
    from aiohttp import web

    from pagectl.router.backends import Backend, parse_backend
    from pagectl.router.proxy import Router, create_router_app
    from pagectl.routing.policy import RoutingPolicy

    router = Router([Backend(parse_backend(s)) for s in specs], RoutingPolicy(policy))
    runner = web.AppRunner(create_router_app(router), access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.sleep(0.5)  # SUB sockets join
    try:
        timings, duration = await run_clients(
            f"http://127.0.0.1:{port}/v1/completions", payloads, concurrency
        )
        spread: dict[str, int] = {}
        for metric in router.metrics.decisions.collect():
            for s in metric.samples:
                if s.name.endswith("_total"):
                    b = s.labels["backend"]
                    spread[b] = spread.get(b, 0) + int(s.value)
        return serving_metrics(timings, duration), spread
    finally:
        await runner.cleanup()


def _daemon_argv(args: argparse.Namespace, port: int, rt: str, extra: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "pagectl", "daemon", "--port", str(port)]
    argv += ["--runtime-dir", rt, "--num-kv-blocks", str(args.num_kv_blocks), *extra]
    argv += args.daemon_arg
    if args.model:
        argv += ["--model", args.model]
    return argv


def _payloads(args: argparse.Namespace) -> list[dict]:
    return [
        {
            "prompt": p,
            "max_tokens": args.output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for p in workload(args)
    ]


def _row(metrics: dict, hits: float, queries: float, spread: list[int]) -> dict:
    return {
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "output_throughput": metrics["output_throughput"],
        "completed": metrics["completed"],
        "failed": metrics["failed"],
        "ttft_p50_ms": metrics["ttft_ms"].get("p50"),
        "requests_per_engine": sorted(spread, reverse=True),
    }


def run_route(args: argparse.Namespace, policies: list[str]) -> dict[str, dict]:
    """Two daemons behind ``pagectl route``, once per policy."""
    daemons: list[tuple[ServerProcess, str, str]] = []
    results = {}
    try:
        for _ in range(2):
            port, pub, rt = free_port(), free_port(), tempfile.mkdtemp(prefix="pagectl-bench-rt-")
            kv = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{pub}"}
            argv = _daemon_argv(args, port, rt, ["--kv-events-config", json.dumps(kv)])
            srv = _spawn("pagectl-daemon", argv, port)
            daemons.append((srv, f"{srv.base_url},kv_events={kv['endpoint']}", rt))
        for srv, _, _ in daemons:
            srv.wait_ready(args.startup_timeout)
        payloads = _payloads(args)
        for policy in policies:
            for _, _, rt in daemons:
                subprocess.run(
                    [sys.executable, "-m", "pagectl", "ctl", "--runtime-dir", rt,
                     "reset-prefix-cache"],
                    check=True,
                    capture_output=True,
                )  # fmt: skip
            before = [scrape(srv.base_url) for srv, _, _ in daemons]
            metrics, spread = asyncio.run(
                run_policy(policy, [s for _, s, _ in daemons], payloads, args.concurrency)
            )
            after = [scrape(srv.base_url) for srv, _, _ in daemons]
            q = delta(after, before, "pagectl:prefix_cache_queries_total")
            hits = delta(after, before, "pagectl:prefix_cache_hits_total")
            results[f"route/{policy}"] = _row(metrics, hits, q, list(spread.values()))
    finally:
        for srv, _, _ in daemons:
            srv.stop()
    return results


def run_dp(args: argparse.Namespace, policies: list[str]) -> dict[str, dict]:
    """One ``--data-parallel-size 2`` daemon per policy, the workload sent to it directly."""
    results = {}
    payloads = _payloads(args)
    for policy in policies:
        port, rt = free_port(), tempfile.mkdtemp(prefix="pagectl-bench-rt-")
        argv = _daemon_argv(args, port, rt, ["--data-parallel-size", "2", "--dp-routing", policy])
        srv = _spawn("pagectl-daemon-dp", argv, port)
        try:
            srv.wait_ready(args.startup_timeout)
            before = scrape(srv.base_url)
            timings, duration = asyncio.run(
                run_clients(srv.base_url + "/v1/completions", payloads, args.concurrency)
            )
            text = scrape_text(srv.base_url)
            after = parse_totals(text)
            q = delta([after], [before], "pagectl:prefix_cache_queries_total")
            hits = delta([after], [before], "pagectl:prefix_cache_hits_total")
            spread = per_engine(text, "pagectl:dp_routing_decisions_total")
            metrics = serving_metrics(timings, duration)
            results[f"dp/{policy}"] = _row(metrics, hits, q, [int(v) for v in spread.values()])
        finally:
            srv.stop()
    return results


def run(args: argparse.Namespace) -> int:
    policies = [p for p in args.policies.split(",") if p]
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - {"route", "dp"}
    if unknown:
        print(f"pagectl bench route: unknown target {sorted(unknown)} (route, dp)", file=sys.stderr)
        return 2
    results: dict[str, dict] = {}
    if "route" in targets:
        results.update(run_route(args, policies))
    if "dp" in targets:
        results.update(run_dp(args, policies))
    print(f"{'target':<18} {'hit rate':>9} {'out tok/s':>10} {'p50 TTFT ms':>12}  per engine")
    for name, r in results.items():
        print(
            f"{name:<18} {r['prefix_hit_rate']:>9.3f} {r['output_throughput']:>10.1f} "
            f"{r['ttft_p50_ms'] or 0:>12.1f}  {r['requests_per_engine']}"
        )
    for t in targets:
        pre, rr = results.get(f"{t}/prefix"), results.get(f"{t}/round_robin")
        if pre and rr and rr["output_throughput"]:
            ratio = pre["output_throughput"] / rr["output_throughput"]
            print(f"{t}: prefix/round_robin output tok/s: {ratio:.2f}x")
    if args.json:
        print(
            json.dumps(
                {
                    "workload": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                    "results": results,
                }
            )
        )
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1
