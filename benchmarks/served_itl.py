"""One streamed request through a real daemon: inter-token latency, and CPU per token by process.

Starts ``python -m pagectl daemon`` on a benchmark model (the pagectl that ``PYTHONPATH``
selects, so two checkouts can be compared in alternation), sends one greedy completion of
``--tokens`` tokens with ``stream: true`` and ``ignore_eos`` after a short warm-up request,
and prints the p50/p90 time between streamed chunks and the CPU time each process of the
daemon (API server, engine) and this client spent per token, read from ``/proc``: where a
served token's time goes beyond the engine step.

    GOMP_SPINCOUNT=10000 python benchmarks/served_itl.py --tokens 512
    PYTHONPATH=/path/to/other/checkout python benchmarks/served_itl.py --quantization int8

Arguments after ``--`` go to the daemon.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pagectl.bench.synthetic import ensure_synthetic_model


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of ``pid`` (None: it has exited)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:90]
    except OSError:
        return f"pid {pid} (exited)"


def descendants(pid: int) -> list[int]:
    out = [pid]
    for p in out:
        with contextlib.suppress(OSError):  # exited meanwhile
            out += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
    return out


def wait_ready(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"daemon not ready after {timeout_s:.0f} s")


def stream(port: int, model: str, tokens: int) -> list[float]:
    """Arrival times of the streamed chunks that carry tokens."""
    body = json.dumps(
        {
            "model": model,
            "prompt": [5, 6, 7, 8] * 8,
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
    )
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise SystemExit(f"HTTP {r.status}: {r.read()[:300]!r}")
    times = []
    while line := r.readline():
        if line.startswith(b"data: ") and b"[DONE]" not in line:
            times.append(time.perf_counter())
    return times


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--synthetic-model", default="qwen3-33m")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--port", type=int, default=18000 + os.getpid() % 1000)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    model = str(ensure_synthetic_model(args.synthetic_model))
    cmd = [sys.executable, "-m", "pagectl", "daemon", "--model", model, "--port", str(args.port)]
    cmd += ["--num-kv-blocks", "2048", "--dtype", args.dtype]
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    daemon = subprocess.Popen(
        cmd + extra, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_ready(args.port, args.startup_timeout)
        stream(args.port, model, 16)  # warm-up
        pids = descendants(daemon.pid)
        names = {p: command_line(p) for p in pids}
        before = {p: cpu_seconds(p) for p in pids}
        mine = time.process_time()
        t0 = time.perf_counter()
        times = stream(args.port, model, args.tokens)
        wall = time.perf_counter() - t0
        mine = time.process_time() - mine
        after = {p: cpu_seconds(p) for p in pids}
        spent = {
            p: a - b for p in pids if (a := after[p]) is not None and (b := before[p]) is not None
        }
    finally:
        os.killpg(daemon.pid, signal.SIGKILL)
        daemon.wait()
    n = len(times)
    gaps = sorted(b - a for a, b in zip(times[1:], times[2:], strict=False))
    print(
        f"{args.synthetic_model} {args.dtype} {args.quantization or ''} load {os.getloadavg()}: "
        f"{n} tokens, {wall * 1e3 / n:.2f} ms/token; ITL p50 {gaps[len(gaps) // 2] * 1e3:.2f} "
        f"p90 {gaps[int(len(gaps) * 0.9)] * 1e3:.2f} ms"
    )
    for p, seconds in spent.items():
        print(f"  {seconds * 1e3 / n:6.2f} ms CPU/token  {names[p]}")
    print(f"  {mine * 1e3 / n:6.2f} ms CPU/token  this client")


if __name__ == "__main__":
    main()
