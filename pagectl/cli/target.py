"""The daemon-choosing flags shared by ``pagectl top``, ``pagectl ctl`` and ``pagectl ls``."""

from __future__ import annotations

import argparse

from pagectl.control.selection import Selector


def add_runtime_dir_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--runtime-dir",
        default=None,
        help="runtime directory of the daemons (default: $PAGECTL_RUNTIME_DIR, "
        "$XDG_RUNTIME_DIR/pagectl or ~/.cache/pagectl/run)",
    )


def add_target_arguments(p: argparse.ArgumentParser, several_urls: bool = False) -> None:
    """``--runtime-dir``, ``--url`` (repeatable with ``several_urls``), ``--port``, ``--pid``."""
    add_runtime_dir_argument(p)
    p.add_argument(
        "--url",
        default=None,
        action="append" if several_urls else "store",
        metavar="URL",
        help="the daemon's HTTP address, e.g. http://127.0.0.1:8000 (its admin endpoints are "
        "read from the runtime file that records it)"
        + ("; repeat it for several daemons, or give a pagectl route URL" if several_urls else ""),
    )
    p.add_argument("--port", type=int, default=None, metavar="N", help="the daemon's HTTP port")
    p.add_argument(
        "--pid", type=int, default=None, metavar="N", help="the daemon's pid (see `pagectl ls`)"
    )


def selector(args: argparse.Namespace) -> Selector:
    """The selector of the flags (the first ``--url`` where it repeats)."""
    url = args.url[0] if isinstance(args.url, list) and args.url else args.url
    return Selector(url=url or None, port=args.port, pid=args.pid)
