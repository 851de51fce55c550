"""``pagectl top``: the live KV-cache console, attached to a daemon or replaying a recording."""

from __future__ import annotations

import argparse
import os

from pagectl.cli.target import add_target_arguments, selector


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_arguments(p, several_urls=True)
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
        "--once",
        action="store_true",
        help="print one snapshot and exit, no console (with several daemons, choose one)",
    )
    p.add_argument("--json", action="store_true", help="with --once: the snapshot as JSON")
    p.add_argument(
        "--stale-after",
        type=float,
        default=3.0,
        metavar="S",
        help="mark the picture stale after S seconds without telemetry (default 3)",
    )


def build_source(args: argparse.Namespace):
    """(the ``AdminSource`` the flags ask for, its ``SelectingResolver`` or None)."""
    if args.replay:
        from pagectl.tui.replay_source import ReplaySource

        return ReplaySource(args.replay, speed=args.speed), None
    from pagectl.tui.daemon_choice import SelectingResolver
    from pagectl.tui.zmq_source import Endpoints, ZmqSource

    if args.telemetry:
        return ZmqSource(Endpoints(args.telemetry, args.control, args.token_file)), None
    from pagectl.control.fleet import plan_fleet

    members = plan_fleet(args.runtime_dir, selector(args), args.url or [])
    if members is not None:
        from pagectl.tui.fleet_source import zmq_fleet

        return zmq_fleet(args.runtime_dir, members, stale_after=args.stale_after), None
    chooser = SelectingResolver(args.runtime_dir, selector(args))
    return ZmqSource(chooser), chooser


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
    if args.json and not args.once:
        print("pagectl top: --json needs --once")
        return 2
    if len(args.url or []) > 1 and (args.once or args.telemetry or args.replay):
        print("pagectl top: several --url need the console (not --once, --telemetry, --replay)")
        return 2
    if args.once:
        return _once(args)
    from pagectl.tui.app import PagectlTop

    source, chooser = build_source(args)
    app = PagectlTop(source, record_path=args.record, stale_after=args.stale_after, chooser=chooser)
    app.run()
    return 0


def _once(args: argparse.Namespace) -> int:
    """``--once``: one snapshot on stdout (text, or JSON with ``--json``), exit 3 when no
    daemon or no telemetry within 5 s, 2 when several daemons and none chosen."""
    import sys

    from pagectl.cli.snapshot_out import recv_one, snapshot_json, snapshot_text
    from pagectl.control.runtime import RuntimeNotFound
    from pagectl.control.selection import AmbiguousRuntime, select_runtime
    from pagectl.control.telemetry_auth import subscriber_token

    info = None
    if args.telemetry:
        endpoint = args.telemetry
        token = subscriber_token(endpoint, args.token_file, None)
    else:
        try:
            info = select_runtime(args.runtime_dir, selector(args))
        except AmbiguousRuntime as e:
            print(f"pagectl top: {e}", file=sys.stderr)
            return 2
        except RuntimeNotFound as e:
            print(f"pagectl top: {e}", file=sys.stderr)
            return 3
        endpoint = info.telemetry_endpoint
        token = subscriber_token(endpoint, info.token_file, info.telemetry_auth)
    snap = recv_one(endpoint, 5.0, token)
    if snap is None:
        print(f"pagectl top: no telemetry from {endpoint} within 5s", file=sys.stderr)
        return 3
    print(snapshot_json(snap, info) if args.json else snapshot_text(snap, info))
    return 0
