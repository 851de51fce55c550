"""Where the ranks of a tensor-parallel group meet, and the process groups they form.

One node (the default): rank 0 hosts a ``TCPStore`` on a loopback port the OS picks and
spawns the other ranks, which connect to it; gloo is bound to the loopback interface too.
Nothing listens beyond the machine.

Several nodes use torch.distributed's standard rendezvous variables on every node:

    MASTER_ADDR   host of rank 0 (the engine), reachable from every node
    MASTER_PORT   the store's port on that host
    NNODES        number of nodes (default 1)
    NODE_RANK     this node's index; 0 is the engine's node

The world size is the tensor-parallel size; each node runs ``tp / NNODES`` ranks, node ``k``
ranks ``[k * L, (k + 1) * L)``. Rank ``r`` of its node uses ``cuda:r`` (offset by the
engine's device index).

Two process groups over the same ranks: the default group (nccl on CUDA, gloo on CPU) carries
the model's collectives and has a finite timeout (``step_timeout_s``); a gloo group with no
practical timeout carries the per-step broadcast, because workers wait in it for as long as
the engine is idle. Batch metadata lives in host memory, so it never round-trips through a
GPU.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pagectl.engine.models.parallel import TPGroup

# Workers wait in the metadata broadcast while the engine is idle: effectively forever.
IDLE_TIMEOUT = datetime.timedelta(days=365)
KEY_PREFIX = "pagectl"


@dataclass(frozen=True)
class Rendezvous:
    """The group's shape and where rank 0's store listens (port 0: any free loopback port)."""

    world_size: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self) -> None:
        if self.nnodes < 1 or self.world_size % self.nnodes:
            raise ValueError(
                f"the tensor-parallel size ({self.world_size}) must be a multiple of the "
                f"number of nodes (NNODES={self.nnodes})"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"NODE_RANK={self.node_rank} is outside [0, NNODES={self.nnodes})")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("a multi-node group needs MASTER_ADDR and MASTER_PORT")

    @property
    def local_size(self) -> int:
        """Ranks on each node."""
        return self.world_size // self.nnodes

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.local_size

    @property
    def local_ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.local_size)

    @classmethod
    def from_env(cls, world_size: int, env: Mapping[str, str] | None = None) -> Rendezvous:
        """Single node unless ``NNODES`` > 1; then ``MASTER_ADDR``, ``MASTER_PORT`` and
        ``NODE_RANK`` are read (``MASTER_*`` alone is ignored on one node)."""
        env = os.environ if env is None else env
        nnodes = int(env.get("NNODES") or 1)
        if nnodes == 1:
            return cls(world_size)
        try:
            port = int(env.get("MASTER_PORT") or 0)
        except ValueError:
            raise ValueError(
                f"MASTER_PORT must be a port number, got {env['MASTER_PORT']!r}"
            ) from None
        return cls(
            world_size,
            nnodes=nnodes,
            node_rank=int(env.get("NODE_RANK") or 0),
            master_addr=env.get("MASTER_ADDR") or "",
            master_port=port,
        )


def backend_for(device_type: str) -> str:
    """nccl on CUDA, gloo on CPU; ``PAGECTL_TP_BACKEND`` overrides (e.g. gloo on CUDA to run
    several ranks on one GPU for testing)."""
    forced = os.environ.get("PAGECTL_TP_BACKEND")
    if forced:
        if forced not in ("gloo", "nccl"):
            raise ValueError(f"PAGECTL_TP_BACKEND must be gloo or nccl, got {forced!r}")
        return forced
    return "nccl" if device_type == "cuda" else "gloo"


def device_for(device_type: str, base_index: int, local_rank: int) -> torch.device:
    if device_type != "cuda":
        return torch.device(device_type)
    dev = torch.device("cuda", base_index + local_rank)
    torch.cuda.set_device(dev)
    return dev


def check_devices(rdzv: Rendezvous, device_type: str, base_index: int, backend: str) -> None:
    """On CUDA with nccl every local rank needs its own GPU (nccl refuses to share one)."""
    if device_type != "cuda" or backend != "nccl":
        return
    have = torch.cuda.device_count()
    need = base_index + rdzv.local_size
    if need > have:
        raise ValueError(
            f"tensor parallelism over {rdzv.local_size} ranks on this node needs CUDA devices "
            f"{base_index}..{need - 1}, but {have} are visible"
        )


def use_loopback_for_gloo() -> None:
    """Bind gloo to the loopback interface (one node only; an explicit setting wins)."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    names = {name for _, name in socket.if_nameindex()}
    for lo in ("lo", "lo0"):
        if lo in names:
            os.environ["GLOO_SOCKET_IFNAME"] = lo
            return


def host_store(rdzv: Rendezvous, timeout_s: float) -> Any:
    """Rank 0's store: on one node a loopback port picked by the OS, else ``MASTER_PORT`` on
    every interface."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if rdzv.nnodes > 1:
        return dist.TCPStore(
            rdzv.master_addr,
            rdzv.master_port,
            rdzv.world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
        )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    return dist.TCPStore(
        "127.0.0.1",
        port,
        rdzv.world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),  # the store owns the listening socket now
    )


def connect_store(host: str, port: int, world_size: int, timeout_s: float) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def init_groups(
    store: Any,
    rank: int,
    world_size: int,
    backend: str,
    device: torch.device,
    step_timeout_s: float,
) -> tuple[TPGroup, Any]:
    """Join the default group and the metadata group. Returns the model's ``TPGroup`` and the
    metadata group. One tensor-parallel group per process: rank 0 checks ``in_a_group``
    before it spawns anything; a worker is a fresh process."""
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=step_timeout_s),
        **kwargs,
    )
    meta = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TPGroup(rank, world_size), meta


def in_a_group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def destroy_groups() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def stage_key(epoch: int, stage: str, rank: int) -> str:
    return f"{KEY_PREFIX}/{epoch}/{stage}/{rank}"


def joined_key(rank: int) -> str:
    return f"{KEY_PREFIX}/joined/{rank}"


def error_key(rank: int) -> str:
    return f"{KEY_PREFIX}/error/{rank}"
