"""Alternating rounds between pagectl and its peer engines, and the median of per-pair ratios.

Every engine stays loaded. Round ``r`` runs a fresh workload (workload seed + r, so no
engine's prefix cache is flattered by an earlier round) through every engine, one after the
other, the order rotated each round so no engine always runs first or last. A round's ratio
is pagectl's figure over the peer's in that round; the reported figure is the median of those
per-pair ratios, which cancels most of a shared machine's drifting load.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pagectl.bench.report import fmt_ratio, format_table
from pagectl.bench.workload import BenchRequest, WorkloadSpec, random_workload

# An engine's run: workload -> (headline figure, extra metrics for the report).
RunFn = Callable[[list[BenchRequest]], tuple[float, dict]]


def round_workloads(spec: WorkloadSpec, rounds: int) -> list[list[BenchRequest]]:
    return [random_workload(replace(spec, seed=spec.seed + r)) for r in range(rounds)]


def alternate(
    engines: dict[str, RunFn], workloads: list[list[BenchRequest]], log: Callable[[str], None]
) -> dict[str, list[dict]]:
    """{engine: [per round {"value", **extra} or {"error"}]} (engines in rotated order)."""
    names = list(engines)
    out: dict[str, list[dict]] = {n: [] for n in names}
    for r, wl in enumerate(workloads):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            try:
                value, extra = engines[name](wl)
                out[name].append({"value": value, **extra})
                log(f"round {r + 1}/{len(workloads)} {name}: {value:.1f}")
            except Exception as e:  # a peer that breaks is reported, not fatal
                out[name].append({"error": f"{type(e).__name__}: {e}"})
                log(f"round {r + 1}/{len(workloads)} {name}: error {e}")
    return out


def pair_ratios(rounds: dict[str, list[dict]], base: str = "pagectl") -> dict[str, dict]:
    """{peer: {"per_round": [base / peer or None], "median": ...}} over rounds both ran."""
    out = {}
    for peer, runs in rounds.items():
        if peer == base:
            continue
        per = []
        for a, b in zip(rounds[base], runs, strict=True):
            ok = "value" in a and "value" in b and b["value"] > 0
            per.append(a["value"] / b["value"] if ok else None)
        done = [x for x in per if x is not None]
        out[peer] = {"per_round": per, "median": statistics.median(done) if done else None}
    return out


def render_rounds(rounds: dict[str, list[dict]], ratios: dict[str, dict], unit: str) -> str:
    n = max(len(v) for v in rounds.values())
    rows: list[list[Any]] = []
    for name, runs in rounds.items():
        cells = [f"{r['value']:.1f}" if "value" in r else "error" for r in runs]
        vals = [r["value"] for r in runs if "value" in r]
        med = statistics.median(vals) if vals else None
        rat = ratios.get(name)
        rows.append(
            [
                name,
                *cells,
                "-" if med is None else f"{med:.1f}",
                "-" if rat is None else fmt_ratio(rat["median"]),
            ]
        )
    headers = [
        "engine",
        *[f"round {i + 1}" for i in range(n)],
        "median",
        "pagectl / this (median of rounds)",
    ]
    notes = [
        f"{name} round {i + 1}: {r['error']}"
        for name, runs in rounds.items()
        for i, r in enumerate(runs)
        if "error" in r
    ]
    per = [
        f"pagectl / {peer} per round: "
        + ", ".join("-" if x is None else f"{x:.2f}" for x in r["per_round"])
        for peer, r in ratios.items()
    ]
    return "\n".join([f"{unit} per round:", format_table(headers, rows), *per, *notes])
