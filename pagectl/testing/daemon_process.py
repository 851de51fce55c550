"""``DaemonProcess``: a real ``pagectl daemon`` subprocess, started and waited for until it
serves (end-to-end tests and the screenshot script)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pagectl.control.protocol import RuntimeInfo


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonProcess:
    """``pagectl daemon`` as a subprocess on a free port with its own runtime dir.

    Args:
        runtime_dir: the runtime directory to use (a test's tmp dir).
        args: extra daemon arguments (``--model DIR`` ...).
        env: extra environment variables.
        nofile: the daemon's RLIMIT_NOFILE (soft and hard), to test behaviour near it.
    """

    def __init__(
        self,
        runtime_dir: str | os.PathLike,
        args: list[str],
        env: dict | None = None,
        *,
        nofile: int | None = None,
    ):
        self.runtime_dir = Path(runtime_dir)
        self.port = free_port()
        self.args = args
        self.env = {**os.environ, "PAGECTL_RUNTIME_DIR": str(self.runtime_dir), **(env or {})}
        self.nofile = nofile
        self.proc: subprocess.Popen | None = None
        self.info: RuntimeInfo | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> DaemonProcess:
        """Launch the daemon and wait until it serves."""
        return self.launch().wait_ready(timeout)

    def launch(self) -> DaemonProcess:
        """Start the subprocess without waiting (start several, then ``wait_ready`` each)."""
        cmd = [
            sys.executable,
            "-m",
            "pagectl",
            "daemon",
            "--port",
            str(self.port),
            "--runtime-dir",
            str(self.runtime_dir),
            *self.args,
        ]
        nofile = self.nofile

        def limit() -> None:
            if nofile is not None:
                import resource

                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(cmd, env=self.env, preexec_fn=limit if nofile else None)
        return self

    def wait_ready(self, timeout: float = 120.0) -> DaemonProcess:
        """Wait until the launched daemon wrote its runtime file and answers /health."""
        from pagectl.control.runtime import find_runtime

        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with status {self.proc.returncode} during start")
            with contextlib.suppress(OSError):
                info = find_runtime(self.runtime_dir / str(self.proc.pid))
                if info.pid == self.proc.pid and self.health() == 200:
                    self.info = info
                    return self
            time.sleep(0.1)
        self.kill()
        raise TimeoutError(f"daemon did not come up within {timeout}s")

    def health(self) -> int | None:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def children(self) -> list[Any]:
        import psutil

        assert self.proc is not None
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def ctl(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run ``pagectl ctl --runtime-dir DIR --port PORT ARGV...`` (this daemon, even with
        others in the same runtime directory) and capture its output."""
        return self.pagectl(
            "ctl", "--runtime-dir", str(self.runtime_dir), "--port", str(self.port), *argv,
            timeout=timeout,
        )  # fmt: skip

    def pagectl(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run ``pagectl ARGV...`` in this daemon's environment and capture its output."""
        return subprocess.run(
            [sys.executable, "-m", "pagectl", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
        )

    def kill(self) -> None:
        """Kill the daemon and every process it started (for fixture teardown)."""
        if self.proc is None:
            return
        kids = self.children()
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        for k in kids:
            with contextlib.suppress(Exception):
                k.kill()
