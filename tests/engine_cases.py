"""The real engine as the token-for-token tests build it, and the cache layouts they run it
under, by name.

A layout's name in a test id says what it stresses: ``chunkN`` a token budget of N (chunked
prefill in mixed steps, prefix-cache hits inside them), ``bsN`` blocks of N tokens,
``preempt`` a pool too small for the module's batch. Modules add suffixes of their own
(``_k8``, ``_n2``) that their tests read.
"""

from __future__ import annotations

from pagectl.engine.args import EngineArgs
from pagectl.engine.builder import BuiltEngine, build_engine
from pagectl.engine.distributed.workers import TPWorkers

DEFAULT = dict(block_size=16)
NO_PREFIX_CACHE = dict(block_size=16, enable_prefix_caching=False)
CHUNK7_BS4 = dict(block_size=4, max_num_batched_tokens=7)
CHUNK13_BS8 = dict(block_size=8, max_num_batched_tokens=13)


def preempt_bs4(num_kv_blocks: int) -> dict:
    """Blocks of 4 and a budget that never chunks, in a pool of ``num_kv_blocks`` that the
    module's batch does not fit: preemption and recompute."""
    return dict(block_size=4, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=64)


def build_tiny_engine(
    path,
    *,
    tp: int = 1,
    workers: TPWorkers | None = None,
    spec: dict | None = None,
    **kw,
) -> BuiltEngine:
    """``build_engine`` on the checkpoint at ``path``: float32 and 256 KV blocks unless ``kw``
    says otherwise (``num_kv_blocks=None``: the default budget), ``tp`` ranks (``workers``: a
    live group of that size, else the builder starts one), ``spec`` the speculative config."""
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("dtype", "float32")
    args = EngineArgs(model=str(path), tensor_parallel_size=tp, speculative_config=spec, **kw)
    return build_engine(args, tp_workers=workers)
