"""``TPWorkers``: rank 0's handle on ranks 1..N-1 of a tensor-parallel group.

Life cycle: ``start`` (start this node's workers as fresh interpreters, launcher.py; wait until every rank has joined the store,
form the process groups, start the watchdog); then per engine ``begin_engine`` (broadcast
its description), the builder's barriers, ``send_step`` once per step, ``end_engine``;
finally ``shutdown``. Engines come and go on the same workers (tests reuse one group for
several models); ``BuiltEngine.shutdown`` ends the workers it started itself.

Faults, and how rank 0 learns of them quickly:
- start-up: rank 0 polls the store for each stage's keys and, between polls, checks that its
  workers are alive and that no rank has posted an error; a stage that takes longer than
  ``startup_timeout_s`` fails naming the ranks that are missing;
- steps: gloo reports a peer that went away at once ("connection closed by peer"); the
  ``collective`` guard turns any failure inside a step into ``TPWorkerError`` naming the rank,
  its pid, exit code and error, and marks the group failed for good;
- idle: the watchdog thread waits on the local workers' process sentinels and records a
  death at once, so ``check_health`` (called by the engine loop between steps) raises;
- a worker death while rank 0 is stuck inside a step for ``hang_grace_s`` (a backend that
  does not notice dead peers, such as nccl) ends this process with exit status 1 rather than
  hanging.

Workers watch their parent and exit when it goes, and rank 0 kills whatever is left at
shutdown: no orphans in any exit path.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing.connection
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from pagectl.engine.distributed import rendezvous as rdv
from pagectl.engine.distributed.launcher import (
    STARTUP_TIMEOUT_S,
    STEP_TIMEOUT_S,
    RankProcess,
    WorkerSpec,
    start_local_ranks,
)
from pagectl.engine.distributed.step_wire import (
    OP_END_ENGINE,
    OP_ENGINE,
    OP_SHUTDOWN,
    StepChannel,
    control_header,
    pack_step,
)
from pagectl.engine.models.parallel import TPGroup
from pagectl.engine.runner.input_batch import StepArrays

HANG_GRACE_S = 10.0
_POLL_S = 0.05


class TPWorkerError(RuntimeError):
    """A tensor-parallel rank died, failed or did not answer in time."""


def _hang_exit(message: str) -> None:
    sys.stderr.write(f"pagectl: {message}; a step is stuck in a collective, exiting\n")
    sys.stderr.flush()
    os._exit(1)


class TPWorkers:
    """Ranks 1..N-1, seen from rank 0 (this process). Use ``TPWorkers.start``."""

    def __init__(
        self,
        rdzv: rdv.Rendezvous,
        device_type: str,
        device_index: int = 0,
        *,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        step_timeout_s: float = STEP_TIMEOUT_S,
        hang_grace_s: float = HANG_GRACE_S,
        on_hang: Callable[[str], None] = _hang_exit,
    ) -> None:
        self.rdzv = rdzv
        self.size = rdzv.world_size
        self.device_type = device_type
        self.device_index = device_index
        self.backend = rdv.backend_for(device_type)
        self.startup_timeout_s = startup_timeout_s
        self.step_timeout_s = step_timeout_s
        self.hang_grace_s = hang_grace_s
        self.on_hang = on_hang
        self.store: Any = None
        self.tp: TPGroup | None = None
        self.channel: StepChannel | None = None
        # Local worker processes by rank (ranks on other nodes are not ours to watch).
        self.procs: dict[int, RankProcess] = {}
        # Set once, by whichever thread sees the first fault; the group is unusable after.
        self.failure: str | None = None
        # Engine number: store keys of one engine's start-up never match another's.
        self.epoch = 0
        self._closed = False
        # monotonic() when the step in progress began (the watchdog's hang check), or None.
        self._step_started: float | None = None
        self._watchdog: threading.Thread | None = None

    # -- start-up ---------------------------------------------------------------------------

    @classmethod
    def start(cls, size: int, device_type: str, device_index: int = 0, **kw: Any) -> TPWorkers:
        """Spawn this node's workers and form the group; ``TPWorkerError`` (or the cause)
        on any failure, with every started process ended."""
        rdzv = rdv.Rendezvous.from_env(size)
        if rdzv.node_rank != 0:
            raise ValueError(
                f"NODE_RANK={rdzv.node_rank}: the engine (rank 0) runs on node 0; start the "
                "other nodes with python -m pagectl.engine.distributed.worker"
            )
        workers = cls(rdzv, device_type, device_index, **kw)
        try:
            workers._start()
        except BaseException:
            workers.shutdown()
            raise
        return workers

    def _start(self) -> None:
        rdzv = self.rdzv
        if rdv.in_a_group():
            raise RuntimeError(
                "this process already belongs to a torch.distributed group (one "
                "tensor-parallel engine per process: shut the other one down first)"
            )
        rdv.check_devices(rdzv, self.device_type, self.device_index, self.backend)
        if rdzv.nnodes == 1:
            rdv.use_loopback_for_gloo()
        self.store = rdv.host_store(rdzv, self.startup_timeout_s)
        spec = WorkerSpec(
            rdzv,
            store_addr="127.0.0.1" if rdzv.nnodes == 1 else rdzv.master_addr,
            store_port=self.store.port,
            device_type=self.device_type,
            device_index=self.device_index,
            startup_timeout_s=self.startup_timeout_s,
            step_timeout_s=self.step_timeout_s,
        )
        self.procs = start_local_ranks(spec, range(1, rdzv.local_size))
        self._wait_keys({r: rdv.joined_key(r) for r in range(1, self.size)}, "join the group")
        device = rdv.device_for(self.device_type, self.device_index, 0)
        self.tp, meta = rdv.init_groups(
            self.store, 0, self.size, self.backend, device, self.step_timeout_s
        )
        self.channel = StepChannel(meta)
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def tp_group(self) -> TPGroup:
        """Rank 0's ``TPGroup`` (for the model's layers)."""
        if self.tp is None:
            raise TPWorkerError("the tensor-parallel group has not been formed")
        return self.tp

    def begin_engine(self, config: dict[str, Any]) -> None:
        """Tell every rank to build the engine ``config`` describes (JSON, see builder)."""
        self.check_health()
        self.epoch += 1
        blob = json.dumps({**config, "epoch": self.epoch}).encode()
        assert self.channel is not None
        with self.collective():
            self.channel.send(control_header(OP_ENGINE, len(blob)), blob)

    # RankSync (sync.py), rank 0's side: poll, watching the others between polls.

    def barrier(self, stage: str) -> None:
        self.store.set(rdv.stage_key(self.epoch, stage, 0), b"1")
        keys = {r: rdv.stage_key(self.epoch, stage, r) for r in range(1, self.size)}
        self._wait_keys(keys, f"reach '{stage}'")

    def agree_min(self, name: str, value: int) -> int:
        self.store.set(rdv.stage_key(self.epoch, name, 0), str(int(value)).encode())
        keys = {r: rdv.stage_key(self.epoch, name, r) for r in range(1, self.size)}
        self._wait_keys(keys, f"report '{name}'")
        return min([int(value)] + [int(self.store.get(k)) for k in keys.values()])

    def _wait_keys(self, keys: dict[int, str], what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = dict(keys)
        sentinels = [p.sentinel for p in self.procs.values()]
        while True:
            self._raise_if_failed()
            pending = {r: k for r, k in pending.items() if not self.store.check([k])}
            if not pending:
                return
            if time.monotonic() > deadline:
                self._fail(
                    f"tensor-parallel ranks {sorted(pending)} did not {what} within "
                    f"{self.startup_timeout_s:.0f}s"
                )
            if sentinels:
                multiprocessing.connection.wait(sentinels, _POLL_S)
            else:
                time.sleep(_POLL_S)

    # -- steps ------------------------------------------------------------------------------

    def send_step(self, arrays: StepArrays | None, copies: list[tuple[int, int]]) -> None:
        """Broadcast one step's batch (call inside ``collective``)."""
        header, payload = pack_step(arrays, copies)
        assert self.channel is not None
        self.channel.send(header, payload)

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Guard a stretch that every rank must run in step (broadcast, forward, logits).

        Any exception inside leaves the ranks out of step: the group is marked failed and a
        worker fault, if there is one, is what gets raised.
        """
        self.check_health()
        self._step_started = time.monotonic()
        try:
            yield
        except BaseException as e:
            err = self.explain(e)
            if err is e:
                raise
            raise err from e
        finally:
            self._step_started = None

    def check_health(self) -> None:
        """Raise ``TPWorkerError`` if any rank has failed (cheap: reads one attribute)."""
        if self.failure is not None:
            raise TPWorkerError(self.failure)
        if self._closed:
            raise TPWorkerError("the tensor-parallel workers have been shut down")

    def explain(self, exc: BaseException) -> BaseException:
        """What to raise for ``exc``, raised while the ranks were meant to act together:
        the failed worker's ``TPWorkerError`` if one failed, else ``exc`` itself. Either way
        the group is marked failed."""
        if self.failure is None and not isinstance(exc, TPWorkerError):
            # A dead peer's socket closes before its exit status is known: give the watchdog
            # a moment to find which worker it was.
            deadline = time.monotonic() + 2.0
            while self.failure is None and time.monotonic() < deadline:
                if self._find_failed_rank() is not None:
                    break
                time.sleep(_POLL_S)
            if self.failure is None:
                self.failure = f"a tensor-parallel step failed on rank 0: {exc!r}"
                return exc
        return TPWorkerError(self.failure or str(exc))

    # -- faults -----------------------------------------------------------------------------

    def _describe(self, rank: int) -> str:
        msg = f"tensor-parallel rank {rank}"
        p = self.procs.get(rank)
        code = None
        if p is not None:
            msg += f" (pid {p.pid})"
            code = _exit_code(p)
            if code is not None:
                msg += f" was killed by signal {-code}" if code < 0 else f" exited ({code})"
        error = None
        if self._has_key(rdv.error_key(rank)):
            with contextlib.suppress(Exception):
                error = self.store.get(rdv.error_key(rank)).decode(errors="replace")
        if error:
            msg += f": {error}"
        elif code is None:
            msg += " failed"
        elif not self._has_key(rdv.joined_key(rank)):
            msg += " before joining the group (see its output)"
        return msg

    def _has_key(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:  # the store may be gone with the group
            return False

    def _find_failed_rank(self) -> int | None:
        for r, p in self.procs.items():
            if p.exitcode is not None:
                self.failure = self.failure or self._describe(r)
                return r
        for r in range(1, self.size):
            if self._has_key(rdv.error_key(r)):
                self.failure = self.failure or self._describe(r)
                return r
        return None

    def _raise_if_failed(self) -> None:
        self.check_health()
        if self._find_failed_rank() is not None:
            raise TPWorkerError(self.failure)

    def _fail(self, message: str) -> None:
        self.failure = self.failure or message
        raise TPWorkerError(message)

    def _watch(self) -> None:
        """Record the first local worker death; end the process if a step then hangs."""
        try:
            self._watch_sentinels()
        finally:
            if self._closed:  # shutdown left the sentinels to us (we were waiting on them)
                for p in self.procs.values():
                    p.close_sentinel()

    def _watch_sentinels(self) -> None:
        by_sentinel = {p.sentinel: r for r, p in self.procs.items()}
        while not self._closed and self.failure is None and by_sentinel:
            ready = multiprocessing.connection.wait(list(by_sentinel), 0.5)
            if ready and not self._closed:
                rank = by_sentinel[ready[0]]  # type: ignore[index]
                self.procs[rank].join(1.0)
                self.failure = self.failure or self._describe(rank)
        failed_at = time.monotonic()
        while not self._closed and self.failure is not None:
            started = self._step_started
            if started is not None and time.monotonic() - max(started, failed_at) > (
                self.hang_grace_s
            ):
                self.on_hang(self.failure)
                return
            time.sleep(0.2)

    # -- shutdown ---------------------------------------------------------------------------

    def end_engine(self) -> None:
        """Release the current engine on every rank (the workers stay)."""
        if self._closed or self.failure is not None or self.channel is None:
            return
        channel = self.channel
        with contextlib.suppress(Exception), self.collective():
            channel.send(control_header(OP_END_ENGINE))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """End every local worker (politely when the group is healthy) and leave the group.
        Idempotent; never raises."""
        if self._closed:
            return
        graceful = self.failure is None and self.channel is not None
        self._closed = True
        if graceful:
            try:
                assert self.channel is not None
                self.channel.send(control_header(OP_SHUTDOWN))
            except Exception:
                graceful = False
        deadline = time.monotonic() + (timeout_s if graceful else 0.5)
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        for p in self.procs.values():
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        watchdog = self._watchdog
        for p in self.procs.values():
            p.close_stdin()
            if watchdog is None or not watchdog.is_alive():
                p.close_sentinel()
        if self.channel is not None and (graceful or self.backend == "gloo"):
            with contextlib.suppress(Exception):
                rdv.destroy_groups()
        self.channel = None
        self.store = None


def _exit_code(p: Any) -> int | None:
    """``p.exitcode``, or None while it runs. Read once, after waiting a moment for it when the
    process is gone: another thread reaping it at the same time can leave it unset briefly."""
    code = p.exitcode
    if code is None and multiprocessing.connection.wait([p.sentinel], 0):
        deadline = time.monotonic() + 1.0
        while code is None and time.monotonic() < deadline:
            time.sleep(0.01)
            code = p.exitcode
    return code


def default_cpu_threads(local_size: int) -> int:
    """Threads for one of ``local_size`` CPU ranks on this machine: its share of the cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // local_size)
