"""Servers a serving benchmark starts: a pagectl daemon, or ``transformers serve``.

Each runs as a subprocess on a free loopback port; ``wait_ready`` polls ``GET /health``
until it answers 200; ``stop`` sends SIGTERM and escalates to SIGKILL after a grace period.
Output goes to a log file, so a server that fails to start can be diagnosed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A server started by the benchmark."""

    name: str
    proc: subprocess.Popen
    base_url: str
    log_path: str

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> None:
        """Block until ``GET /health`` answers 200. Raises RuntimeError with the log tail."""
        deadline = time.monotonic() + timeout_s
        url = self.base_url + "/health"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with status {self.proc.returncode} before it was ready:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _spawn(name: str, argv: list[str], port: int, env: dict | None = None) -> ServerProcess:
    fd, log_path = tempfile.mkstemp(prefix=f"pagectl-bench-{name}-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env or os.environ.copy(),
        )
    return ServerProcess(name, proc, f"http://127.0.0.1:{port}", log_path)


def daemon_argv(model: str, port: int, runtime_dir: str, engine_flags: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pagectl",
        "daemon",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--runtime-dir",
        runtime_dir,
        *engine_flags,
    ]


def start_daemon(model: str, engine_flags: list[str]) -> ServerProcess:
    """``pagectl daemon`` on a free port, with a private runtime dir (no clash with a user's)."""
    port = free_port()
    runtime_dir = tempfile.mkdtemp(prefix="pagectl-bench-rt-")
    return _spawn("pagectl-daemon", daemon_argv(model, port, runtime_dir, engine_flags), port)


def transformers_env(extra_pythonpath: str | None = None) -> dict:
    """Environment for ``transformers serve``: offline, extra import path first if given."""
    env = os.environ.copy()
    # Its update check would try the network.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    if extra_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (extra_pythonpath, env.get("PYTHONPATH")) if p
        )
    return env


def transformers_serve_available(extra_pythonpath: str | None = None) -> str | None:
    """None when ``transformers serve`` can run here, else the reason it cannot.

    Checked in a child interpreter with the server's environment, so that serving extras
    installed in a separate directory (``extra_pythonpath``) never load into this process.
    """
    probe = (
        "import sys\n"
        "from transformers.utils.import_utils import is_serve_available\n"
        "sys.exit(0 if is_serve_available() else 3)\n"
    )
    try:
        rc = subprocess.run(
            [sys.executable, "-c", probe],
            env=transformers_env(extra_pythonpath),
            capture_output=True,
            timeout=120,
        ).returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"could not probe transformers: {e}"
    if rc == 3:
        return "transformers serve needs its serving extras (pip install 'transformers[serving]')"
    if rc != 0:
        return "transformers is not importable"
    return None


def transformers_serve_argv(
    model: str, port: int, *, num_blocks: int | None = None, max_batch_tokens: int | None = None
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "transformers.cli.transformers",
        "serve",
        model,
        "--continuous-batching",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ]
    if num_blocks is not None:
        argv += ["--cb-num-blocks", str(num_blocks)]
    if max_batch_tokens is not None:
        argv += ["--cb-max-batch-tokens", str(max_batch_tokens)]
    return argv


def start_transformers_serve(
    model: str,
    *,
    num_blocks: int | None = None,
    max_batch_tokens: int | None = None,
    extra_pythonpath: str | None = None,
) -> ServerProcess:
    port = free_port()
    argv = transformers_serve_argv(
        model, port, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens
    )
    return _spawn("transformers-serve", argv, port, transformers_env(extra_pythonpath))
