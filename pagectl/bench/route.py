"""``pagectl bench route``: prefix routing against round robin over two daemons, in one run.

Two daemons publish KV-cache events; for each policy a ``pagectl route`` router (in this
process) is put in front of them, both prefix caches are reset, and the same workload runs
through it: ``--system-prompts`` shared system prompts, each followed by
``--turns`` different user turns, in a seeded random order. Reported per policy: the prefix-cache hit
rate over both daemons (hit tokens / looked-up tokens, from their /metrics), output tok/s,
and how the router spread the requests.
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


_SERIES = re.compile(r"^(pagectl:[a-z_]+_total) ([0-9.eE+-]+)$", re.M)


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return {k: float(v) for k, v in _SERIES.findall(r.read().decode())}


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


def run(args: argparse.Namespace) -> int:
    policies = [p for p in args.policies.split(",") if p]
    daemons: list[tuple[ServerProcess, str, str]] = []
    try:
        for _ in range(2):
            port, pub, rt = free_port(), free_port(), tempfile.mkdtemp(prefix="pagectl-bench-rt-")
            kv = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{pub}"}
            argv = [sys.executable, "-m", "pagectl", "daemon", "--port", str(port)]
            argv += ["--runtime-dir", rt, "--num-kv-blocks", str(args.num_kv_blocks)]
            argv += ["--kv-events-config", json.dumps(kv), *args.daemon_arg]
            if args.model:
                argv += ["--model", args.model]
            srv = _spawn("pagectl-daemon", argv, port)
            daemons.append((srv, f"{srv.base_url},kv_events={kv['endpoint']}", rt))
        for srv, _, _ in daemons:
            srv.wait_ready(args.startup_timeout)
        prompts = workload(args)
        payloads = [
            {
                "prompt": p,
                "max_tokens": args.output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            for p in prompts
        ]
        results = {}
        for policy in policies:
            for _, _, rt in daemons:
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "pagectl",
                        "ctl",
                        "--runtime-dir",
                        rt,
                        "reset-prefix-cache",
                    ],
                    check=True,
                    capture_output=True,
                )
            before = [scrape(srv.base_url) for srv, _, _ in daemons]
            metrics, spread = asyncio.run(
                run_policy(policy, [s for _, s, _ in daemons], payloads, args.concurrency)
            )
            after = [scrape(srv.base_url) for srv, _, _ in daemons]
            q = delta(after, before, "pagectl:prefix_cache_queries_total")
            hits = delta(after, before, "pagectl:prefix_cache_hits_total")
            results[policy] = {
                "prefix_hit_rate": hits / q if q else 0.0,
                "output_throughput": metrics["output_throughput"],
                "completed": metrics["completed"],
                "failed": metrics["failed"],
                "ttft_p50_ms": metrics["ttft_ms"].get("p50"),
                "requests_per_backend": sorted(spread.values(), reverse=True),
            }
    finally:
        for srv, _, _ in daemons:
            srv.stop()
    print(f"{'policy':<12} {'hit rate':>9} {'out tok/s':>10} {'p50 TTFT ms':>12}  per backend")
    for policy, r in results.items():
        print(
            f"{policy:<12} {r['prefix_hit_rate']:>9.3f} {r['output_throughput']:>10.1f} "
            f"{r['ttft_p50_ms'] or 0:>12.1f}  {r['requests_per_backend']}"
        )
    if "prefix" in results and "round_robin" in results:
        rr = results["round_robin"]["output_throughput"]
        print(
            f"prefix/round_robin output tok/s: {results['prefix']['output_throughput'] / rr:.2f}x"
        )
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
