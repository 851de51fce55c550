"""``pagectl ls``: every live daemon in the runtime directory, and stale files cleaned.

Columns: pid, model, HTTP URL, TP, uptime, and the engine state as the daemon itself reports
it over the admin channel (``no answer`` when it does not answer within the timeout,
``read-only`` when its control token cannot be read). Directories left by dead daemons are
removed and named on stderr.
"""

from __future__ import annotations

import argparse
import sys

from pagectl.cli.target import add_runtime_dir_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_runtime_dir_argument(p)
    add_ls_options(p)


def add_ls_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object per daemon")
    p.add_argument(
        "--ls-timeout",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds to wait for each daemon's state (default 1)",
    )


def engine_state(info, timeout: float) -> str:
    """The daemon's engine state over its control channel, or why it is unknown."""
    from pagectl.control.client import AdminClient, AdminError
    from pagectl.control.runtime import read_token
    from pagectl.engine.commands import GetStatus

    token = read_token(info.token_file)
    if token is None:
        return "read-only"
    with AdminClient(info.control_endpoint, token, client_name="ls") as client:
        try:
            return str(client.command(GetStatus(), timeout=timeout).get("engine_state", "?"))
        except AdminError as e:
            return "no answer" if e.kind == "timeout" else e.kind


def run(args: argparse.Namespace) -> int:
    import json

    from pagectl.control.runtime import default_runtime_dir, live_runtimes, remove_stale_runtimes
    from pagectl.control.selection import describe_runtimes

    base = args.runtime_dir or str(default_runtime_dir())
    for d in remove_stale_runtimes(base):
        print(f"removed the runtime files of dead daemon {d.name} ({d})", file=sys.stderr)
    infos = live_runtimes(base)
    states = [engine_state(i, args.ls_timeout) for i in infos]
    if args.json:
        import msgspec

        for info, state in zip(infos, states, strict=True):
            print(json.dumps({**msgspec.to_builtins(info), "state": state}, sort_keys=True))
        return 0
    if not infos:
        print(f"no running pagectl daemon in {base}", file=sys.stderr)
        return 0
    print(describe_runtimes(infos, states))
    return 0
