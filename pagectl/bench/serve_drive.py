"""Driving an OpenAI-compatible server with a token-id workload: the request bodies, the
served model's name, and one timed run of streaming clients (``drive``).

Shared by ``bench serve`` and its ``--peer`` rounds (peer_rounds.py); it imports neither.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

from pagectl.bench.stats import serving_metrics
from pagectl.bench.workload import BenchRequest


def pagectl_payloads(
    model_name: str, workload: list[BenchRequest], temperature: float
) -> list[dict]:
    return [
        {
            "model": model_name,
            "prompt": r.prompt_token_ids,
            "max_tokens": r.output_len,
            "temperature": temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for r in workload
    ]


def served_model_name(base_url: str, headers: dict, fallback: str) -> str:
    req = urllib.request.Request(base_url + "/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            data = json.loads(r.read())
        return data["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        return fallback


def drive(
    base_url: str, payloads: list[dict], concurrency: int, headers: dict, timeout_s: float
) -> dict:
    """Warm up with one short request, then run every payload; returns the metrics.

    A server whose warm-up request fails is reported as skipped, with the error.
    """
    from pagectl.bench.client import run_clients

    url = base_url + "/v1/completions"
    warm = dict(payloads[0], max_tokens=2)
    done, _ = asyncio.run(run_clients(url, [warm], 1, headers=headers, request_timeout_s=timeout_s))
    if not done or not done[0].ok:
        return {"skipped": f"warm-up request failed: {done[0].error if done else 'no answer'}"}
    timings, duration = asyncio.run(
        run_clients(url, payloads, concurrency, headers=headers, request_timeout_s=timeout_s)
    )
    metrics = serving_metrics(timings, duration)
    errors = [t.error for t in timings if t.error]
    if errors:
        metrics["first_error"] = errors[0]
    return metrics
