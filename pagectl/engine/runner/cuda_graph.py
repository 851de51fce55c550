"""CUDA graphs for pure-decode steps (CUDA with a graph-capable attention backend only).

A decode step of ``n`` sequences replays the graph captured for the smallest bucket size
``>= n`` (1, 2, 4, 8, then multiples of 16 up to ``max_batch_size``). Every captured graph
reads the same static inputs (``attention.backend.DecodeGraphBuffers``, padding rows
described there); what the backend may and may not do under capture is the contract in
``attention/backend.py`` (``prepare_graph``).

Only the model body is captured; the LM head runs eagerly on the rows that sample. Steps
with prefill rows run eagerly. Disabled by ``enforce_eager``; never used for dynamic NTK
rope (its frequencies depend on host-side lengths). Capture time and the memory the graphs
hold are logged and kept in ``capture_s`` / ``capture_bytes``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pagectl.engine.attention.backend import DecodeGraphBuffers

if TYPE_CHECKING:
    from pagectl.engine.runner.input_batch import StepBatch
    from pagectl.engine.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)


def bucket_sizes(max_batch_size: int) -> list[int]:
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch_size}
    sizes.update(range(16, max_batch_size + 1, 16))
    sizes.add(max_batch_size)
    return sorted(sizes)


class CudaGraphApi:
    """What capturing needs from ``torch.cuda`` (tests substitute a CPU fake)."""

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def capture(self, graph: Any, pool: Any, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record ``fn`` into ``graph`` (sharing ``pool``); returns its static output."""
        with torch.cuda.graph(graph, pool=pool):
            return fn()

    def pool(self, graph: Any) -> Any:
        return graph.pool()

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def free_memory(self, device: torch.device) -> int:
        return int(torch.cuda.mem_get_info(device)[0])


class DecodeCudaGraphs:
    def __init__(
        self, runner: ModelRunner, max_batch_size: int, api: CudaGraphApi | None = None
    ) -> None:
        self.runner = runner
        self.api = api or CudaGraphApi()
        self.sizes = bucket_sizes(max_batch_size)
        self.max_batch_size = self.sizes[-1]
        self.buffers = DecodeGraphBuffers.allocate(
            self.max_batch_size,
            runner.max_model_len,
            runner.block_size,
            runner.kv.scratch_block,
            runner.device,
        )
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self.capture_s = 0.0
        self.capture_bytes = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first (later ones reuse its memory pool)."""
        model = self.runner.model
        backend = self.runner.backend
        dev = self.runner.device
        buf = self.buffers
        api = self.api
        t0 = time.perf_counter()
        api.synchronize(dev)
        free_before = api.free_memory(dev)
        pool = None
        for n in reversed(self.sizes):
            meta = buf.metadata(n)
            backend.prepare_graph(meta)

            def body(n: int = n, meta: Any = meta) -> torch.Tensor:
                return model(buf.input_ids[:n], buf.positions[:n], meta)

            body()  # warm-up (and kernel compilation) outside the graph
            api.synchronize(dev)
            graph = api.new_graph()
            out = api.capture(graph, pool, body)
            if pool is None:
                pool = api.pool(graph)
            self._graphs[n] = (graph, out)
        api.synchronize(dev)
        free_after = api.free_memory(dev)
        self.capture_s = time.perf_counter() - t0
        self.capture_bytes = max(0, free_before - free_after)
        log.info(
            "captured %d CUDA graphs (decode batch sizes 1..%d, %s backend) in %.1f s, "
            "holding %.1f MiB",
            len(self.sizes),
            self.max_batch_size,
            backend.name,
            self.capture_s,
            self.capture_bytes / 2**20,
        )

    def can_run(self, batch: StepBatch) -> bool:
        m = batch.meta
        return m.token_seq_lens is None and self.buffers.fits(m)

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Replay the bucket for ``batch``; returns the hidden rows ``[n, hidden]``."""
        n = batch.meta.num_seqs
        size = next(s for s in self.sizes if s >= n)
        self.buffers.load(batch.input_ids, batch.positions, batch.meta, size)
        graph, out = self._graphs[size]
        graph.replay()
        return out[:n]
