"""``pagectl top``: the live KV-cache console, attached to a daemon or replaying a recording."""

from __future__ import annotations

import argparse
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--runtime-dir",
        help="where the daemon recorded its endpoints (default: $PAGECTL_RUNTIME_DIR, "
        "$XDG_RUNTIME_DIR/pagectl or ~/.cache/pagectl/run)",
    )
    p.add_argument(
        "--telemetry", metavar="ENDPOINT", help="telemetry PUB endpoint (skips the runtime file)"
    )
    p.add_argument(
        "--control", metavar="ENDPOINT", help="control ROUTER endpoint (omit: read-only)"
    )
    p.add_argument(
        "--token-file", metavar="FILE", help="the daemon's control token file (omit: read-only)"
    )
    p.add_argument(
        "--record", metavar="FILE", help="save the telemetry stream to FILE (see docs/TUI.md)"
    )
    p.add_argument("--replay", metavar="FILE", help="play back a recording instead of attaching")
    p.add_argument(
        "--speed", type=float, default=1.0, help="replay speed (default 1; > and < change it live)"
    )
    p.add_argument(
        "--stale-after",
        type=float,
        default=3.0,
        metavar="S",
        help="mark the picture stale after S seconds without telemetry (default 3)",
    )


def build_source(args: argparse.Namespace):
    """The ``AdminSource`` the flags ask for."""
    if args.replay:
        from pagectl.tui.replay_source import ReplaySource

        return ReplaySource(args.replay, speed=args.speed)
    from pagectl.tui.zmq_source import Endpoints, ZmqSource, runtime_resolver

    if args.telemetry:
        return ZmqSource(Endpoints(args.telemetry, args.control, args.token_file))
    return ZmqSource(runtime_resolver(args.runtime_dir))


def run(args: argparse.Namespace) -> int:
    if args.replay and args.record:
        print("pagectl top: --record and --replay cannot be combined")
        return 2
    if args.replay and not os.path.isfile(args.replay):
        print(f"pagectl top: no such recording: {args.replay}")
        return 2
    if (args.control or args.token_file) and not args.telemetry:
        print("pagectl top: --control/--token-file need --telemetry (or use --runtime-dir)")
        return 2
    if args.speed <= 0:
        print("pagectl top: --speed must be > 0")
        return 2
    from pagectl.tui.app import PagectlTop

    app = PagectlTop(build_source(args), record_path=args.record, stale_after=args.stale_after)
    app.run()
    return 0
