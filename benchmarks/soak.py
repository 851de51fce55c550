"""A bounded loopback soak of a real daemon: leaks, errors and memory over time.

    python benchmarks/soak.py --minutes 60                  # the full run (tiny Qwen3, CPU)
    python benchmarks/soak.py --minutes 5 --interval 30     # a short one
    python benchmarks/soak.py --model DIR --concurrency 8   # another model

Starts ``pagectl daemon`` on 127.0.0.1 (a tiny random-weight Qwen3 built locally unless
``--model``), then ``--concurrency`` client threads send a fixed mix until the time is up:
streamed and plain completions, chat, n=2, requests dropped mid-stream, and requests that
must be refused (400: out-of-range integers, lone surrogates, an unknown field type).

Every ``--interval`` seconds the load pauses until the daemon is idle and one line is
printed: requests and errors in the interval, KV blocks still in use (must be 0 when idle:
anything else leaked), admission slots and unstarted engine requests (``/metrics``; must be
0), the RSS of the API-server and engine processes, and the machine's 1-minute load.
"errors" counts answers that were wrong: a 5xx, a refused request that was not refused, or
a good one that failed; expected 400s are counted apart. The last line is a JSON summary,
including the engine's RSS change over the second half of the run and its spread (max over
min) over the last 30 minutes. Nothing leaves loopback; the daemon is stopped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models

from pagectl.control.client import AdminClient  # noqa: E402
from pagectl.engine.commands import GetStatus  # noqa: E402
from pagectl.testing.daemon_process import DaemonProcess  # noqa: E402

GOOD = [
    ("/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 24}),
    ("/v1/completions", {"prompt": "import os\n", "max_tokens": 16, "stream": True}),
    ("/v1/completions", {"prompt": "class A:", "max_tokens": 8, "n": 2, "temperature": 0.8}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16, "stream": True},
    ),
    ("/v1/completions", {"prompt": "x = [", "max_tokens": 12, "logprobs": 2}),
]
BAD = [
    ("/v1/completions", {"prompt": "hi", "priority": 2**64}),
    ("/v1/completions", {"prompt": "hi", "temperature": 10**400}),
    ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfff"}]}),
    ("/v1/completions", {"prompt": {"not": "a prompt"}}),
]


class Counts:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = self.errors = self.refused = self.dropped = 0
        self.last_error = ""

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def take(self) -> dict:
        with self.lock:
            out = {
                "requests": self.requests,
                "errors": self.errors,
                "refused_400": self.refused,
                "dropped": self.dropped,
            }
            self.requests = self.errors = self.refused = self.dropped = 0
            return out


def _post(url: str, path: str, body: dict, **kw) -> requests.Response:
    data = json.dumps(body).encode()  # lone surrogates go out as \\ud800 escapes
    return requests.post(
        url + path, data=data, headers={"Content-Type": "application/json"}, timeout=120, **kw
    )


def worker(url: str, counts: Counts, go: threading.Event, stop: threading.Event, seed: int):
    rng = random.Random(seed)
    while not stop.is_set():
        go.wait()
        if stop.is_set():
            return
        roll = rng.random()
        try:
            if roll < 0.15:
                path, body = rng.choice(BAD)
                r = _post(url, path, body)
                if r.status_code == 400:
                    counts.add(requests=1, refused=1)
                else:
                    counts.add(requests=1, errors=1)
                    counts.last_error = f"{path} bad body got {r.status_code}"
            elif roll < 0.25:  # a stream the client drops after the first event
                r = _post(
                    url,
                    "/v1/completions",
                    {"prompt": "for i in", "max_tokens": 64, "stream": True},
                    stream=True,
                )
                next(r.iter_lines(), None)
                r.close()
                counts.add(requests=1, dropped=1)
            else:
                path, body = rng.choice(GOOD)
                r = _post(url, path, body)
                text = r.text
                ok = r.status_code == 200 and (
                    not body.get("stream") or text.rstrip().endswith("data: [DONE]")
                )
                counts.add(requests=1, errors=0 if ok else 1)
                if not ok:
                    counts.last_error = f"{path} got {r.status_code}: {text[:200]}"
        except requests.RequestException as e:
            counts.add(requests=1, errors=1)
            counts.last_error = f"{type(e).__name__}: {e}"


def _metric(url: str, name: str) -> float:
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def quiesce(d: DaemonProcess, admin: AdminClient, timeout: float = 60.0) -> dict:
    """Wait until nothing runs; then what is left is a leak."""
    deadline = time.monotonic() + timeout
    while True:
        st = admin.command(GetStatus())
        active = _metric(d.base_url, "pagectl:http_requests_active")
        if (st["num_running"] + st["num_waiting"] == 0 and active == 0) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.05)
    return {
        "leaked_blocks": st["kv"]["num_used_blocks"],
        "slots": int(active),
        "unstarted": int(_metric(d.base_url, "pagectl:engine_requests_unstarted")),
    }


def _spread(rows: list[dict], minutes: float) -> float | None:
    """(max / min - 1) of the engine's RSS over the rows of the last ``minutes``, in %."""
    if not rows or rows[-1]["t_min"] < minutes:
        return None
    tail = [r["engine_rss_mb"] for r in rows if r["t_min"] >= rows[-1]["t_min"] - minutes]
    return round(100 * (max(tail) / min(tail) - 1), 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="how long to run (default 60)")
    ap.add_argument("--interval", type=float, default=60.0, help="seconds between report lines")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--model", default=None, help="model dir (default: a tiny Qwen3 built here)")
    ap.add_argument("--num-kv-blocks", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pagectl-soak-"))
    model = args.model
    if model is None:
        from tiny_models import build_tiny_model

        model = str(work / "tiny-qwen3")
        build_tiny_model(Path(model), "qwen3")
    d = DaemonProcess(
        work / "run",
        [
            "--model", model,
            "--num-kv-blocks", str(args.num_kv_blocks),
            "--max-model-len", str(args.max_model_len),
            "--max-num-queued-requests", str(4 * args.concurrency),
        ],
    )  # fmt: skip
    d.start(timeout=600)
    counts = Counts()
    go, stop = threading.Event(), threading.Event()
    go.set()
    threads = [
        threading.Thread(target=worker, args=(d.base_url, counts, go, stop, args.seed + i))
        for i in range(args.concurrency)
    ]
    rows: list[dict] = []
    try:
        api = psutil.Process(d.proc.pid)
        (engine,) = [p for p in api.children() if "engine_process" in " ".join(p.cmdline())]
        assert d.info is not None
        admin = AdminClient.from_runtime(d.info)
        for t in threads:
            t.start()
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        print(
            "  t_min  requests  errors  refused  dropped  leaked_blocks  slots  unstarted"
            "  api_rss_mb  engine_rss_mb  load1",
            flush=True,
        )
        while time.monotonic() < end:
            time.sleep(max(0.0, min(args.interval, end - time.monotonic())))
            go.clear()  # pause: let in-flight requests finish, then look for leaks
            time.sleep(0.2)
            left = quiesce(d, admin)
            row = {
                "t_min": round((time.monotonic() - t0) / 60, 2),
                **counts.take(),
                **left,
                "api_rss_mb": round(api.memory_info().rss / 2**20, 1),
                "engine_rss_mb": round(engine.memory_info().rss / 2**20, 1),
                "load1": round(os.getloadavg()[0], 1),
            }
            rows.append(row)
            go.set()
            print(
                f"{row['t_min']:7.2f} {row['requests']:9d} {row['errors']:7d} "
                f"{row['refused_400']:8d} {row['dropped']:8d} {row['leaked_blocks']:14d} "
                f"{row['slots']:6d} {row['unstarted']:10d} {row['api_rss_mb']:11.1f} "
                f"{row['engine_rss_mb']:14.1f} {row['load1']:6.1f}",
                flush=True,
            )
            if counts.last_error:
                print(f"         last error: {counts.last_error}", flush=True)
                counts.last_error = ""
    finally:
        stop.set()
        go.set()
        for t in threads:
            t.join(150)
        with contextlib.suppress(Exception):
            admin.close()
        d.proc.terminate()
        with contextlib.suppress(Exception):
            d.proc.wait(60)
        d.kill()
    half = [r for r in rows if r["t_min"] >= rows[-1]["t_min"] / 2] if rows else []
    summary = {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "requests": sum(r["requests"] for r in rows),
        "errors": sum(r["errors"] for r in rows),
        "max_leaked_blocks": max((r["leaked_blocks"] for r in rows), default=None),
        "max_slots": max((r["slots"] for r in rows), default=None),
        "engine_rss_mb_first_last": [rows[0]["engine_rss_mb"], rows[-1]["engine_rss_mb"]]
        if rows
        else None,
        "engine_rss_change_second_half_pct": round(
            100 * (half[-1]["engine_rss_mb"] / half[0]["engine_rss_mb"] - 1), 2
        )
        if len(half) >= 2
        else None,
        # The target: engine RSS within 5% over the last 30 minutes (max over min, in %).
        "engine_rss_spread_last_30min_pct": _spread(rows, 30.0),
        "api_rss_mb_first_last": [rows[0]["api_rss_mb"], rows[-1]["api_rss_mb"]] if rows else None,
        "load": os.getloadavg(),
    }
    print(json.dumps(summary), flush=True)
    ok = rows and summary["errors"] == 0 and summary["max_leaked_blocks"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
