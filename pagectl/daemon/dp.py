"""What a daemon of N data-parallel engines gives each engine: its rank, endpoints, CPU
threads, device, and the KV-event stream the dispatcher follows.

Rules (vLLM's where it has one):
- Rank i's admin, internal and KV-event endpoints are rank 0's with ``rank_endpoint``: a
  ``tcp://`` port plus i (port 0 stays 0: the OS picks), an ``ipc://`` path with ``_dp{i}``
  appended. Rank 0's are the single engine's, so a DP=1 daemon is unchanged.
- CPU threads per engine: ``--dp-cpu-threads`` or an even split of the cores the daemon may
  use; an engine with tensor parallel size k splits its share over its k ranks.
- CUDA: engine i runs its ranks on devices ``base + i*k .. base + i*k + k-1``.
- Prefix routing needs each engine's KV events: the daemon subscribes to the endpoints of
  ``--kv-events-config`` when they are bound here, else to private ipc:// sockets it adds.
"""

from __future__ import annotations

import os
from typing import Any

from pagectl.engine.args import EngineArgs


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Rank ``rank``'s copy of rank 0's ``endpoint`` (see the module docstring)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, sep, port = endpoint.rpartition(":")
        if sep and port.isdigit() and "]" not in port:
            return f"{base}:{int(port) + rank}" if int(port) else endpoint
        return endpoint
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        root, ext = os.path.splitext(path)
        return f"ipc://{root}_dp{rank}{ext}"
    raise ValueError(f"cannot derive a per-engine endpoint from {endpoint!r}")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def engine_args_for_rank(
    args: EngineArgs, rank: int, size: int, *, cpu_threads: int | None, cuda: bool
) -> EngineArgs:
    """``args`` for data-parallel rank ``rank`` of ``size`` (threads, device)."""
    from dataclasses import replace

    tp = args.tensor_parallel_size
    if cuda:
        base = 0
        if args.device.startswith("cuda:"):
            base = int(args.device.split(":", 1)[1])
        return replace(args, device=f"cuda:{base + rank * tp}")
    if args.num_threads is not None:
        return args  # --num-threads is per rank, as without data parallelism
    per_engine = cpu_threads or max(1, available_cores() // size)
    return replace(args, num_threads=max(1, per_engine // tp))


def wants_cuda(device: str) -> bool:
    """Whether the engines run on CUDA ("auto" asks torch, as the builder would)."""
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import torch

    return bool(torch.cuda.is_available())


def kv_events_for_rank(
    cfg: dict[str, Any] | None, rank: int, private: tuple[str, str] | None
) -> tuple[dict[str, Any] | None, tuple[str, str | None] | None]:
    """(the engine's KV-events config, the (PUB, replay) endpoints the dispatcher follows).

    ``cfg`` is ``--kv-events-config`` as parsed (active) or None; ``private`` the ipc://
    (PUB, replay) pair to use when the dispatcher needs events that ``cfg`` does not give
    (None: it needs none).
    """
    from pagectl.engine_process.kv_events import should_bind

    if cfg is not None:
        cfg = dict(cfg)
        cfg["endpoint"] = rank_endpoint(cfg["endpoint"], rank)
        if cfg.get("replay_endpoint"):
            cfg["replay_endpoint"] = rank_endpoint(cfg["replay_endpoint"], rank)
        if private is None:
            return cfg, None
        if not should_bind(cfg["endpoint"]):
            raise ValueError(
                "--dp-routing prefix follows each engine's KV events, but --kv-events-config "
                f"connects out to {cfg['endpoint']}; bind it on this host (loopback or ipc://) "
                "or choose --dp-routing load"
            )
        return cfg, (cfg["endpoint"], cfg.get("replay_endpoint"))
    if private is None:
        return None, None
    pub, replay = private
    own = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub}
    own["replay_endpoint"] = replay
    return own, (pub, replay)
