"""KV-cache events: what the block pool's own transitions tell an outside index.

The pool records one entry per transition while a recorder is attached (``BlockPool.events``;
None costs one attribute test per transition):

- a full, computed block registered under its hash -> ``stored`` (hash, parent hash, tokens);
- a registered block handed out again (lazy eviction) -> ``removed`` (hash);
- every cached prefix forgotten (``reset_prefix_cache``, prefix caching turned off) ->
  ``cleared``.

Consecutive ``stored`` entries whose chain continues (the next parent is the previous hash)
merge into one entry, and consecutive ``removed`` entries merge, so one request's prompt is one
event, as vLLM publishes it. ``take()`` hands the pending entries over once per engine step;
the engine process turns them into vLLM's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` (``engine_process/kv_events.py``). Stdlib only: the pool must not depend
on a wire format.
"""

from __future__ import annotations


class StoredBlocks:
    """Blocks registered in the prefix cache, a contiguous stretch of one hash chain."""

    __slots__ = ("block_hashes", "parent_block_hash", "token_ids")

    def __init__(self, block_hash: bytes, parent: bytes | None, token_ids: tuple[int, ...]):
        # Hashes of the registered blocks, in chain order.
        self.block_hashes: list[bytes] = [block_hash]
        # Hash of the block before the first one (None: the first is a request's first block).
        self.parent_block_hash = parent
        # Every token of every block, concatenated (block_size per block).
        self.token_ids: list[int] = list(token_ids)


class RemovedBlocks:
    """Blocks no longer findable in the prefix cache (evicted)."""

    __slots__ = ("block_hashes",)

    def __init__(self, block_hash: bytes) -> None:
        self.block_hashes: list[bytes] = [block_hash]


class AllCleared:
    """Every cached prefix was forgotten; an index drops all it knows of this engine."""

    __slots__ = ()


KVEvent = StoredBlocks | RemovedBlocks | AllCleared


class KVEventRecorder:
    """Pending KV events of the current step, merged as they arrive (see module docstring)."""

    __slots__ = ("pending", "num_events")

    def __init__(self) -> None:
        self.pending: list[KVEvent] = []
        # Transitions recorded since start (before merging).
        self.num_events = 0

    def stored(self, block_hash: bytes, parent: bytes | None, token_ids: tuple[int, ...]) -> None:
        self.num_events += 1
        pending = self.pending
        if pending:
            last = pending[-1]
            if (
                isinstance(last, StoredBlocks)
                and parent is not None
                and last.block_hashes[-1] == parent
            ):
                last.block_hashes.append(block_hash)
                last.token_ids.extend(token_ids)
                return
        pending.append(StoredBlocks(block_hash, parent, token_ids))

    def removed(self, block_hash: bytes) -> None:
        self.num_events += 1
        pending = self.pending
        if pending and isinstance(pending[-1], RemovedBlocks):
            pending[-1].block_hashes.append(block_hash)
        else:
            pending.append(RemovedBlocks(block_hash))

    def cleared(self) -> None:
        # Everything recorded before is superseded: a consumer would drop it anyway.
        self.num_events += 1
        self.pending = [AllCleared()]

    def take(self) -> list[KVEvent]:
        """The pending events, oldest first; the recorder starts a new batch."""
        out = self.pending
        if out:
            self.pending = []
        return out
