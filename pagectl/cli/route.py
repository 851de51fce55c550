"""``pagectl route``: an OpenAI-compatible reverse proxy in front of several daemons, routing
each request by prefix affinity (from the daemons' KV-cache events), load, or in turn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        action="append",
        required=True,
        metavar="URL[,kv_events=EP][,replay=EP][,topic=T]",
        help="a daemon (repeatable); kv_events: its --kv-events-config endpoint, replay: its "
        "replay_endpoint, topic: its topic",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--routing",
        choices=("prefix", "load", "round_robin"),
        default="prefix",
        help="prefix (default): the backend holding the longest prefix of the request, "
        "within --max-skew; load: the least loaded; round_robin: in turn",
    )
    p.add_argument(
        "--max-skew",
        type=int,
        default=4,
        help="prefix routing sends to a backend at most this many requests busier than the "
        "least loaded one (default 4)",
    )
    p.add_argument(
        "--health-interval", type=float, default=1.0, help="seconds between health checks"
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning"),
        help="debug: every routing decision's inputs",
    )


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from pagectl.router.backends import Backend, parse_backend
    from pagectl.router.proxy import Router, create_router_app
    from pagectl.routing.policy import RoutingPolicy

    try:
        specs = [parse_backend(b) for b in args.backend]
        policy = RoutingPolicy(args.routing, args.max_skew)
    except ValueError as e:
        print(f"pagectl route: {e}", file=sys.stderr)
        return 2
    if args.health_interval <= 0:
        print("pagectl route: --health-interval must be > 0", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    router = Router([Backend(s) for s in specs], policy, health_interval=args.health_interval)
    app = create_router_app(router)

    async def serve() -> int:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        try:
            await site.start()
        except OSError as e:
            print(f"pagectl route: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
            await runner.cleanup()
            return 1
        print(
            f"pagectl route: {args.routing} over {len(specs)} backends at "
            f"http://{args.host}:{args.port}",
            file=sys.stderr,
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()
        return 0

    return asyncio.run(serve())
