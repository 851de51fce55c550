"""The daemon's ``/metrics`` page (Prometheus text format) as the tests read it."""

from __future__ import annotations


def metric_values(text: str) -> dict[str, float]:
    """{series name with its labels: value} for every sample line of ``text``."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
