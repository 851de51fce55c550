"""``pagectl route``: an OpenAI-compatible reverse proxy in front of several daemons, routing
each request by prefix affinity (from the daemons' KV-cache events), load, or in turn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from pagectl.router.config import LOG_LEVELS
from pagectl.routing.policy import POLICIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Every flag defaults to None: an absent flag leaves the --config file's value (or the
    # built-in default, ``router/config.py:RouteSettings``).
    p.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file with any of these settings (keys as the flags: max_skew, backends "
        "= [...], ...); flags given override it (see docs/ROUTING.md)",
    )
    p.add_argument(
        "--backend",
        action="append",
        metavar="URL[,kv_events=EP][,replay=EP][,topic=T]",
        help="a daemon (repeatable; replaces the file's backends); kv_events: its "
        "--kv-events-config endpoint, replay: its replay_endpoint, topic: its topic",
    )
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port (default 8080)")
    p.add_argument(
        "--routing",
        choices=POLICIES,
        default=None,
        help="prefix (default): the backend holding the longest prefix of the request, "
        "within --max-skew; load: the least loaded; round_robin: in turn",
    )
    p.add_argument(
        "--max-skew",
        type=int,
        default=None,
        help="prefix routing sends to a backend at most this many requests busier than the "
        "least loaded one (default 4)",
    )
    p.add_argument(
        "--health-interval",
        type=float,
        default=None,
        metavar="S",
        help="seconds between health checks (default 1)",
    )
    p.add_argument(
        "--health-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds a health check may take (default: the interval, at least 1)",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds to connect to a backend before trying another (default 5)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds a whole proxied request may take, streams included (default: none; "
        "0: none); past it the client gets a 504, or an error event mid-stream",
    )
    p.add_argument(
        "--log-level",
        default=None,
        choices=LOG_LEVELS,
        help="info (default); debug: every routing decision's inputs",
    )


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from pagectl.router.backends import Backend
    from pagectl.router.config import ConfigError, settings_from
    from pagectl.router.proxy import Router, create_router_app
    from pagectl.routing.policy import RoutingPolicy

    try:
        cfg = settings_from(args)
        policy = RoutingPolicy(cfg.routing, cfg.max_skew)
    except (ConfigError, ValueError) as e:
        print(f"pagectl route: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    router = Router(
        [Backend(s) for s in cfg.backends],
        policy,
        health_interval=cfg.health_interval,
        health_timeout=cfg.health_timeout,
        connect_timeout=cfg.connect_timeout,
        request_timeout=cfg.request_timeout,
    )
    app = create_router_app(router)

    async def serve() -> int:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, cfg.host, cfg.port)
        try:
            await site.start()
        except OSError as e:
            print(f"pagectl route: cannot listen on {cfg.host}:{cfg.port}: {e}", file=sys.stderr)
            await runner.cleanup()
            return 1
        print(
            f"pagectl route: {cfg.routing} over {len(cfg.backends)} backends at "
            f"http://{cfg.host}:{cfg.port}",
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
