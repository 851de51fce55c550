"""The ``pagectl`` command line: ``daemon | top | ctl | ls | generate | route | bench``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args)``
(returning the exit status). Modules are imported only when their command runs, so that
``pagectl ctl`` does not import torch and ``pagectl daemon`` does not import textual.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = {
    "daemon": ("pagectl.cli.daemon", "serve a model: OpenAI-compatible HTTP API + admin channel"),
    "top": ("pagectl.cli.top", "live KV-cache operator console attached to a running daemon"),
    "ctl": ("pagectl.cli.ctl", "scripted control of a running daemon (status, set, pause, ...)"),
    "ls": ("pagectl.cli.ls", "list the running daemons (pid, model, URL, TP, uptime, state)"),
    "generate": ("pagectl.cli.generate", "generate a continuation offline, without a server"),
    "route": ("pagectl.cli.route", "reverse proxy routing requests over several daemons"),
    "bench": ("pagectl.cli.bench", "throughput and serving benchmarks against peers"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the chosen subcommand's module is imported to add its flags."""
    from pagectl import __version__

    chosen = argv[0] if argv else None
    parser = argparse.ArgumentParser(
        prog="pagectl",
        description="A paged-KV-cache LLM serving daemon with a live KV-cache console.",
    )
    parser.add_argument("--version", action="version", version=f"pagectl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
            parser.set_defaults(_chosen_parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        # An unknown flag of a command prints that command's usage, not the top-level one.
        (getattr(args, "_chosen_parser", None) or parser).error(
            f"unrecognized arguments: {' '.join(extra)}"
        )
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    module = importlib.import_module(args._module)
    try:
        code = int(module.run(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`pagectl ctl status | head`): no traceback, and no second
        # error when Python flushes stdout at exit. 141 is what a shell reports for SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return code


if __name__ == "__main__":
    raise SystemExit(main())
