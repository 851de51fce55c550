"""``pagectl bench throughput | serve``: benchmarks against the peers an operator would use.

``throughput`` runs offline through the LLM API; ``serve`` drives a daemon (a running one, or
one it starts) with concurrent streaming clients. See docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "throughput": (
        "pagectl.bench.throughput",
        "offline throughput through the LLM API, beside transformers",
    ),
    "serve": (
        "pagectl.bench.serve",
        "online serving: concurrent streaming clients against a daemon",
    ),
    "route": (
        "pagectl.bench.route",
        "prefix routing against round robin through pagectl route over two daemons",
    ),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH")
    sub.required = True
    for name, (module, help_text) in BENCHES.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_bench_module=module)
        importlib.import_module(module).add_arguments(sp)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args._bench_module).run(args) or 0)
