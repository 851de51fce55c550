"""The worker process of a tensor-parallel group: ranks 1..N-1.

A worker joins the group, then serves rank 0's broadcasts until told to stop:

- ``OP_ENGINE``: build the engine described (its shard of the weights, its KV heads, the
  same runner as rank 0) through the same code as rank 0, meeting it at the start-up
  barriers;
- ``OP_STEP``: the KV block copies and the forward for the broadcast batch, the LM head's
  share of the logits going to rank 0 (which samples);
- ``OP_END_ENGINE``: release the engine (the group stays for the next one);
- ``OP_SHUTDOWN``: leave the group and exit 0.

Each rank is a fresh interpreter (launcher.py starts ``python -m
pagectl.engine.distributed.worker --rank R --spec JSON``). Any error is posted to the store
under the worker's rank (rank 0 reports it) and ends the process with status 1. A worker
also exits as soon as its parent (rank 0) is gone.

On other nodes of a multi-node group run

    MASTER_ADDR=host0 MASTER_PORT=29500 NNODES=2 NODE_RANK=1 \\
        python -m pagectl.engine.distributed.worker --tp 4

which starts this node's ranks and exits with the first failing rank's status.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing.connection
import os
import signal
import sys
import threading
import traceback
from typing import Any

from pagectl.engine.distributed import rendezvous as rdv
from pagectl.engine.distributed.launcher import (
    STARTUP_TIMEOUT_S,
    STEP_TIMEOUT_S,
    WorkerSpec,
    start_local_ranks,
)

# The process that started this rank (it holds our stdin's write end), when one did.
_parent_pid: int | None = None


def _exit_with_parent() -> None:
    """End this process as soon as its stdin reaches end of file: the parent is gone."""
    global _parent_pid
    _parent_pid = os.getppid()

    def watch() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _parent_gone() -> bool:
    return _parent_pid is not None and os.getppid() != _parent_pid


def run_rank_process(spec: WorkerSpec, rank: int) -> int:
    """The body of ``python -m pagectl.engine.distributed.worker --rank R --spec JSON``."""
    # Ctrl-C in a terminal reaches the whole process group; rank 0 decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    code = serve_rank(spec, rank)
    # Leave without the interpreter's teardown (seconds with torch loaded; nothing of ours
    # needs it): rank 0 waits for its workers to go at shutdown.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def serve_rank(spec: WorkerSpec, rank: int) -> int:
    """Join the group as ``rank`` and serve rank 0 until ``OP_SHUTDOWN`` (0) or an error (1)."""
    rdzv = spec.rdzv
    store = None
    try:
        store = rdv.connect_store(
            spec.store_addr, spec.store_port, rdzv.world_size, spec.startup_timeout_s
        )
        store.set(rdv.joined_key(rank), b"1")
        device = rdv.device_for(spec.device_type, spec.device_index, rank - rdzv.first_rank)
        tp, meta = rdv.init_groups(
            store,
            rank,
            rdzv.world_size,
            rdv.backend_for(spec.device_type),
            device,
            spec.step_timeout_s,
        )
        return _serve(tp, meta, store, device, rdzv.local_size, spec.startup_timeout_s)
    except Exception as e:
        if _parent_gone():
            return 1  # rank 0 is gone: nothing to report to
        traceback.print_exc()
        if store is not None:
            with contextlib.suppress(Exception):  # the store went with rank 0
                store.set(rdv.error_key(rank), f"{type(e).__name__}: {e}".encode())
        return 1
    finally:
        with contextlib.suppress(Exception):  # leaving a broken group
            rdv.destroy_groups()


def _serve(
    tp: Any, meta: Any, store: Any, device: Any, local_size: int, startup_timeout_s: float
) -> int:
    import torch

    from pagectl.engine.builder import build_worker_runner
    from pagectl.engine.distributed.step_wire import (
        OP_END_ENGINE,
        OP_ENGINE,
        OP_SHUTDOWN,
        OP_STEP,
        StepChannel,
        unpack_step,
    )
    from pagectl.engine.distributed.sync import WorkerSync

    channel = StepChannel(meta)
    runner = None
    while True:
        header, payload = channel.recv()
        op = int(header[0])
        if op == OP_STEP:
            if runner is None:
                raise RuntimeError("a step arrived before any engine was built")
            arrays, copies = unpack_step(header, payload)  # type: ignore[arg-type]
            with torch.inference_mode():
                runner.run_arrays(arrays, copies)
        elif op == OP_ENGINE:
            assert isinstance(payload, bytes)
            config = json.loads(payload)
            sync = WorkerSync(store, tp.rank, tp.size, config["epoch"], startup_timeout_s)
            runner = build_worker_runner(config, tp, sync, device, local_size)
        elif op == OP_END_ENGINE:
            if runner is not None:
                runner.release()
            runner = None
        elif op == OP_SHUTDOWN:
            return 0
        else:
            raise RuntimeError(f"unknown tensor-parallel message {op}")


# -- other nodes --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run this node's ranks of a multi-node group (see the module docstring)."""
    env = os.environ
    p = argparse.ArgumentParser(
        prog="python -m pagectl.engine.distributed.worker",
        description="Start this node's ranks of a pagectl tensor-parallel group.",
    )
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (world size)")
    p.add_argument("--nnodes", type=int, default=int(env.get("NNODES") or 1))
    p.add_argument("--node-rank", type=int, default=int(env.get("NODE_RANK") or 0))
    p.add_argument("--master-addr", default=env.get("MASTER_ADDR") or "")
    p.add_argument("--master-port", type=int, default=int(env.get("MASTER_PORT") or 0))
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument("--device-index", type=int, default=0, help="first CUDA device to use")
    p.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S)
    p.add_argument("--step-timeout", type=float, default=STEP_TIMEOUT_S)
    # One rank of this node, started by rank 0 or by this command on another node.
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.rank is not None:
        if a.spec is None:
            p.error("--rank needs --spec")
        return run_rank_process(WorkerSpec.from_json(a.spec), a.rank)
    if a.tp is None:
        p.error("the following arguments are required: --tp")
    rdzv = rdv.Rendezvous(a.tp, a.nnodes, a.node_rank, a.master_addr, a.master_port)
    if rdzv.node_rank == 0:
        p.error("node 0 is the engine's node: start pagectl daemon (or LLM) there")
    from pagectl.engine.builder import resolve_device

    device_type = resolve_device(a.device).type
    rdv.check_devices(rdzv, device_type, a.device_index, rdv.backend_for(device_type))
    spec = WorkerSpec(
        rdzv,
        store_addr=rdzv.master_addr,
        store_port=rdzv.master_port,
        device_type=device_type,
        device_index=a.device_index,
        startup_timeout_s=a.startup_timeout,
        step_timeout_s=a.step_timeout,
    )
    procs = start_local_ranks(spec, rdzv.local_ranks)

    def stop(*_: Any) -> None:
        for proc in procs.values():
            proc.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    pending = dict(procs)
    status = 0
    while pending:
        multiprocessing.connection.wait([proc.sentinel for proc in pending.values()])
        for rank, proc in list(pending.items()):
            proc.join(1.0)
            if proc.exitcode is None:
                continue
            del pending[rank]
            proc.close()
            if proc.exitcode and not status:
                status = proc.exitcode if proc.exitcode > 0 else 1
                stop()  # one rank failed: the group is over
    return status


if __name__ == "__main__":
    raise SystemExit(main())
