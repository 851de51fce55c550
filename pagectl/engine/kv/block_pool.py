"""The block pool: fixed-size KV blocks, refcounts, an O(1) LRU free list, the hash map.

Invariants (checked by the property tests):
- every block is either in the free list (``ref_cnt == 0``) or referenced by at least one
  block table (``ref_cnt`` == number of block tables that hold it);
- ``cached_blocks[h] is b`` implies ``b.block_hash == h`` and ``b`` holds the tokens that
  hash to ``h``; a block with ``block_hash is None`` is not in the map;
- the free list is in eviction order: the head is handed out first. Unhashed blocks are put at
  the head when freed (nothing to lose), hashed ones at the tail (least recently used last).
  A request frees its blocks tail first, so its tail is evicted before its head.

Two byte arrays mirror each block's refcount (clipped to 255) and whether it is registered in
the prefix cache, so that a telemetry snapshot of a large pool is a memory copy.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagectl.engine.kv.events import KVEventRecorder


class KVBlock:
    """One block of ``block_size`` token slots in every layer's KV tensors."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        # Number of block tables holding this block; 0 means it sits in the free list.
        self.ref_cnt = 0
        # Set while the block is registered in the prefix cache (full and computed).
        self.block_hash: bytes | None = None
        # The block's tokens while it is registered (for the console's block preview).
        self.token_ids: tuple[int, ...] | None = None
        # Intrusive free-list links; both None when the block is not free.
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks through the blocks' own links; O(1) everything."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: never handed out
        self._tail = KVBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVBlock:
        b = self._head.next_free
        if b is self._tail or b is None:
            raise IndexError("no free blocks")
        self.remove(b)
        return b

    def remove(self, b: KVBlock) -> None:
        prev, nxt = b.prev_free, b.next_free
        assert prev is not None and nxt is not None, f"{b} is not in the free list"
        prev.next_free = nxt
        nxt.prev_free = prev
        b.prev_free = b.next_free = None
        self.num_free_blocks -= 1

    def append(self, b: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = b
        b.prev_free = last
        b.next_free = self._tail
        self._tail.prev_free = b
        self.num_free_blocks += 1

    def appendleft(self, b: KVBlock) -> None:
        first = self._head.next_free
        assert first is not None
        self._head.next_free = b
        b.prev_free = self._head
        b.next_free = first
        first.prev_free = b
        self.num_free_blocks += 1

    def __iter__(self):
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free

    def ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    """All KV blocks, the free list and the prefix-cache hash map."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVBlock] = {}
        # Telemetry mirrors: refcount clipped to 255, and 1 where the block is registered.
        self.ref_bytes = bytearray(num_blocks)
        self.hashed_bytes = bytearray(num_blocks)
        # Blocks evicted from the prefix cache since start (a cached block handed out again).
        self.num_evictions = 0
        # Free blocks that are registered in the prefix cache (evictable cached prefixes).
        self.num_cached_free_blocks = 0
        # Most blocks in use at once since start (or since the last reset of this field).
        self.peak_used_blocks = 0
        # KV-cache events of this pool's transitions (None: nobody listens, nothing recorded).
        self.events: KVEventRecorder | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: never used, evicted, or cached-but-unused."""
        return self.free_block_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_block_queue.num_free_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Hand out ``n`` blocks from the head of the free list, each with ``ref_cnt == 1``.

        A block still registered in the prefix cache is evicted here (lazy eviction).
        """
        if n > self.free_block_queue.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        popleft = self.free_block_queue.popleft
        ref_bytes = self.ref_bytes
        for _ in range(n):
            b = popleft()
            if b.block_hash is not None:
                self.num_cached_free_blocks -= 1
                self._evict(b)
            b.ref_cnt = 1
            ref_bytes[b.block_id] = 1
            out.append(b)
        used = self.num_blocks - self.free_block_queue.num_free_blocks
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used
        return out

    def _evict(self, b: KVBlock) -> None:
        h = b.block_hash
        if h is not None and self.cached_blocks.get(h) is b:
            del self.cached_blocks[h]
        b.block_hash = None
        b.token_ids = None
        self.hashed_bytes[b.block_id] = 0
        self.num_evictions += 1
        if self.events is not None and h is not None:
            self.events.removed(h)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (prefix hit or fork)."""
        queue = self.free_block_queue
        ref_bytes = self.ref_bytes
        for b in blocks:
            if b.ref_cnt == 0:
                queue.remove(b)
                if b.block_hash is not None:
                    self.num_cached_free_blocks -= 1
            b.ref_cnt += 1
            ref_bytes[b.block_id] = b.ref_cnt if b.ref_cnt < 255 else 255

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in the given order (eviction order).

        A block whose count reaches zero joins the free list: at the tail if it holds a cached
        prefix (it stays findable until handed out again), at the head otherwise.
        """
        queue = self.free_block_queue
        ref_bytes = self.ref_bytes
        for b in ordered_blocks:
            b.ref_cnt -= 1
            rc = b.ref_cnt
            assert rc >= 0, f"{b} freed more often than referenced"
            ref_bytes[b.block_id] = rc if rc < 255 else 255
            if rc == 0:
                if b.block_hash is None:
                    queue.appendleft(b)
                else:
                    queue.append(b)
                    self.num_cached_free_blocks += 1

    def cache_block(
        self,
        b: KVBlock,
        block_hash: bytes,
        token_ids: tuple[int, ...],
        parent_hash: bytes | None = None,
    ) -> bool:
        """Register a full, computed block under its hash. False if the hash is taken.

        ``parent_hash`` is the hash of the block before it in its chain (None for a first
        block); only KV events carry it.

        When another block already holds the same content, the map keeps the first one and this
        block stays unregistered (it is freed to the head of the list like any unhashed block).
        """
        if b.block_hash is not None or block_hash in self.cached_blocks:
            return False
        b.block_hash = block_hash
        b.token_ids = token_ids
        self.cached_blocks[block_hash] = b
        self.hashed_bytes[b.block_id] = 1
        if self.events is not None:
            self.events.stored(block_hash, parent_hash, token_ids)
        return True

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached_blocks.get(block_hash)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix. Blocks in use keep their contents and owners.

        Returns how many cached-but-unused blocks were released (moved to the head of the free
        list as plain free blocks).
        """
        released = []
        for b in self.cached_blocks.values():
            b.block_hash = None
            b.token_ids = None
            self.hashed_bytes[b.block_id] = 0
            if b.ref_cnt == 0:
                released.append(b)
        self.cached_blocks.clear()
        self.num_cached_free_blocks = 0
        if self.events is not None:
            self.events.cleared()
        queue = self.free_block_queue
        for b in released:
            queue.remove(b)
            queue.appendleft(b)
        return len(released)
