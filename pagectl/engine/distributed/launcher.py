"""Starting a node's tensor-parallel ranks, each in a fresh interpreter.

Every rank but rank 0 runs ``python -m pagectl.engine.distributed.worker --rank R --spec
JSON``: a new interpreter that imports pagectl and nothing of the caller's, so a script that
builds a tensor-parallel ``LLM`` at import time (no ``if __name__ == "__main__":`` guard)
works as it is. The same command starts the ranks of the other nodes of a multi-node group
(worker.py's ``main``).

Lifetimes, both ways, without polling:
- a rank holds the read end of its stdin pipe, whose write end only its parent has: end of
  file means the parent is gone, and the rank exits at once (worker.py);
- the parent holds the read end of a pipe whose write end only the rank has (its
  ``sentinel``): it becomes readable when the rank exits, however it died.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import msgspec

from pagectl.engine.distributed import rendezvous as rdv

STARTUP_TIMEOUT_S = float(os.environ.get("PAGECTL_TP_STARTUP_TIMEOUT_S") or 600)
STEP_TIMEOUT_S = float(os.environ.get("PAGECTL_TP_STEP_TIMEOUT_S") or 300)
WORKER_MODULE = "pagectl.engine.distributed.worker"
# The directory holding the pagectl package: the ranks import this copy of it.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])


@dataclass(frozen=True)
class WorkerSpec:
    """What a node's ranks need to join the group (JSON on each rank's command line)."""

    rdzv: rdv.Rendezvous
    # Rank 0's store: the loopback port it picked on one node, MASTER_ADDR:MASTER_PORT else.
    store_addr: str
    store_port: int
    device_type: str
    # The node's first CUDA device: local rank r uses device_index + r.
    device_index: int
    startup_timeout_s: float
    step_timeout_s: float

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return msgspec.json.decode(text, type=cls)


class RankProcess:
    """One rank's process, seen from the process that started it."""

    def __init__(self, rank: int, popen: subprocess.Popen, sentinel: int) -> None:
        self.rank = rank
        self.popen = popen
        self.pid = popen.pid
        # Readable (end of file) once the process has exited.
        self.sentinel = sentinel
        self._closed = False
        self._lock = threading.Lock()

    @property
    def exitcode(self) -> int | None:
        """None while it runs; else its exit status, or -N when killed by signal N."""
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def terminate(self) -> None:
        if self.is_alive():
            with contextlib.suppress(ProcessLookupError):
                self.popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            with contextlib.suppress(ProcessLookupError):
                self.popen.kill()

    def close_sentinel(self) -> None:
        """Release the sentinel, once, when nothing waits on it any more."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(OSError):
            os.close(self.sentinel)

    def close_stdin(self) -> None:
        """Close the pipe the rank watches: it exits (status 1) if still running."""
        if self.popen.stdin is not None:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()

    def close(self) -> None:
        self.close_stdin()
        self.close_sentinel()


def worker_command(spec: WorkerSpec, rank: int) -> list[str]:
    return [sys.executable, "-m", WORKER_MODULE, "--rank", str(rank), "--spec", spec.to_json()]


def start_local_ranks(spec: WorkerSpec, ranks: range) -> dict[int, RankProcess]:
    """Start ``ranks`` of this node, each as ``python -m pagectl.engine.distributed.worker``."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + path if path else "")
    procs: dict[int, RankProcess] = {}
    try:
        for rank in ranks:
            read_end, write_end = os.pipe()
            try:
                popen = subprocess.Popen(
                    worker_command(spec, rank),
                    stdin=subprocess.PIPE,
                    env=env,
                    pass_fds=(write_end,),
                )
            except BaseException:
                os.close(read_end)
                raise
            finally:
                os.close(write_end)
            procs[rank] = RankProcess(rank, popen, read_end)
    except BaseException:
        for p in procs.values():
            p.kill()
            p.join()
            p.close()
        raise
    return procs
