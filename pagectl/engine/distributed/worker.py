"""The worker process of a tensor-parallel group: ranks 1..N-1.

A worker joins the group, then serves rank 0's broadcasts until told to stop:

- ``OP_ENGINE``: build the engine described (its shard of the weights, its KV heads, the
  same runner as rank 0) through the same code as rank 0, meeting it at the start-up
  barriers;
- ``OP_STEP``: the KV block copies and the forward for the broadcast batch, the LM head's
  share of the logits going to rank 0 (which samples);
- ``OP_END_ENGINE``: release the engine (the group stays for the next one);
- ``OP_SHUTDOWN``: leave the group and exit 0.

Any error is posted to the store under the worker's rank (rank 0 reports it) and ends the
process with status 1. A spawned worker also exits as soon as its parent (rank 0) is gone.

On other nodes of a multi-node group run

    MASTER_ADDR=host0 MASTER_PORT=29500 NNODES=2 NODE_RANK=1 \\
        python -m pagectl.engine.distributed.worker --tp 4

which starts this node's ranks and exits with the first failing rank's status.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

from pagectl.engine.distributed import rendezvous as rdv


@dataclass(frozen=True)
class WorkerSpec:
    """What a node's spawned ranks need to join the group (pickled into each process)."""

    rdzv: rdv.Rendezvous
    # Rank 0's store: the loopback port it picked on one node, MASTER_ADDR:MASTER_PORT else.
    store_addr: str
    store_port: int
    device_type: str
    # The node's first CUDA device: local rank r uses device_index + r.
    device_index: int
    startup_timeout_s: float
    step_timeout_s: float


def spawn_local_workers(spec: WorkerSpec, ranks: range) -> dict[int, Any]:
    """Start ``ranks`` of this node as spawned processes (daemonic: never outlive us)."""
    ctx = mp.get_context("spawn")
    procs = {}
    for rank in ranks:
        p = ctx.Process(
            target=run_spawned_worker,
            args=(spec, rank),
            name=f"pagectl-tp-rank{rank}",
            daemon=True,
        )
        p.start()
        procs[rank] = p
    return procs


def _exit_with_parent() -> None:
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_spawned_worker(spec: WorkerSpec, rank: int) -> None:
    """Target of a spawned worker process."""
    # Ctrl-C in a terminal reaches the whole process group; rank 0 decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    sys.exit(serve_rank(spec, rank))


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
        parent = mp.parent_process()
        if parent is not None and not parent.is_alive():
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
    from pagectl.engine.distributed.workers import STARTUP_TIMEOUT_S, STEP_TIMEOUT_S

    env = os.environ
    p = argparse.ArgumentParser(
        prog="python -m pagectl.engine.distributed.worker",
        description="Start this node's ranks of a pagectl tensor-parallel group.",
    )
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size (world size)")
    p.add_argument("--nnodes", type=int, default=int(env.get("NNODES") or 1))
    p.add_argument("--node-rank", type=int, default=int(env.get("NODE_RANK") or 0))
    p.add_argument("--master-addr", default=env.get("MASTER_ADDR") or "")
    p.add_argument("--master-port", type=int, default=int(env.get("MASTER_PORT") or 0))
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument("--device-index", type=int, default=0, help="first CUDA device to use")
    p.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S)
    p.add_argument("--step-timeout", type=float, default=STEP_TIMEOUT_S)
    a = p.parse_args(argv)
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
    procs = spawn_local_workers(spec, rdzv.local_ranks)

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
            if proc.exitcode is None:
                continue
            del pending[rank]
            if proc.exitcode and not status:
                status = proc.exitcode if proc.exitcode > 0 else 1
                stop()  # one rank failed: the group is over
    return status


if __name__ == "__main__":
    raise SystemExit(main())
