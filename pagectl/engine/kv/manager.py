"""The KV cache manager: block tables, prefix lookup, slot allocation, fork and copy-on-write.

It works on ``Request`` objects and the block pool only; it never touches KV tensors. Copies
needed for copy-on-write are queued in ``pending_copies`` as (src, dst) block ids; the
scheduler hands them to the model runner, which must apply them before the next forward.
"""

from __future__ import annotations

from pagectl.engine.kv.block_pool import BlockPool, KVBlock
from pagectl.engine.kv.hashing import hash_request_blocks
from pagectl.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        # (src, dst) block copies requested by copy-on-write since the last drain.
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------

    def find_cached_prefix(self, req: Request) -> list[KVBlock]:
        """The longest run of cached blocks matching ``req``'s leading full blocks.

        Capped so that at least the last token of what the request must compute is computed
        (its logits are needed). Takes no references: ``allocate_slots`` does.
        """
        if not self.enable_prefix_caching or req.num_computed_tokens:
            return []
        if req.sampling_params.prompt_logprobs is not None:
            return []  # every prompt position must be computed to score it
        cap_tokens = min(req.num_tokens - 1, req.target_num_tokens)
        max_blocks = cap_tokens // self.block_size
        if max_blocks <= 0:
            return []
        hashes = hash_request_blocks(
            req.all_token_ids, self.block_size, req.block_hashes, req.cache_salt, max_blocks
        )
        hits: list[KVBlock] = []
        get = self.pool.cached_blocks.get
        for h in hashes[:max_blocks]:
            b = get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def cache_full_blocks(self, req: Request) -> None:
        """Offer ``req``'s newly completed (full and computed) blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        n_full = req.num_computed_tokens // self.block_size
        start_block = req.num_registered_blocks
        if n_full <= start_block:
            return
        bs = self.block_size
        tokens = req.all_token_ids
        hashes = hash_request_blocks(tokens, bs, req.block_hashes, req.cache_salt, n_full)
        cache_block = self.pool.cache_block
        blocks = req.blocks
        for i in range(start_block, n_full):
            b = blocks[i]
            if b.block_hash is None:
                parent = hashes[i - 1] if i else None
                cache_block(b, hashes[i], tuple(tokens[i * bs : (i + 1) * bs]), parent)
        req.num_registered_blocks = n_full

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    # -- allocation ---------------------------------------------------------------------

    def allocate_slots(
        self, req: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``req`` (after its prefix hits).

        All or nothing: returns False, changing nothing, when the pool cannot supply the
        blocks. On success the hit blocks are referenced and appended, new blocks appended,
        and a shared partially filled last block that is about to be written is replaced by a
        private copy (queued in ``pending_copies``).
        """
        bs = self.block_size
        blocks = req.blocks
        hits = new_computed_blocks or []
        num_computed = req.num_computed_tokens + len(hits) * bs
        need = -(-(num_computed + num_new_tokens) // bs) - len(blocks) - len(hits)
        # Copy-on-write: the next slot lies inside a block that others hold too.
        cow = bool(num_new_tokens > 0 and num_computed % bs and blocks and blocks[-1].ref_cnt > 1)
        # Hit blocks sitting in the free list (cached, unused) leave it too.
        num_from_free = max(need, 0) + cow + sum(1 for b in hits if b.ref_cnt == 0)
        if num_from_free > self.pool.free_block_queue.num_free_blocks:
            return False
        if hits:
            self.pool.touch(hits)
            blocks.extend(hits)
            req.block_ids.extend(b.block_id for b in hits)
        if cow:
            shared = blocks[-1]
            (private,) = self.pool.get_new_blocks(1)
            self.pending_copies.append((shared.block_id, private.block_id))
            blocks[-1] = private
            req.block_ids[-1] = private.block_id
            self.pool.free_blocks((shared,))
        if need > 0:
            new = self.pool.get_new_blocks(need)
            blocks.extend(new)
            req.block_ids.extend(b.block_id for b in new)
        return True

    def release_slots_beyond(self, req: Request, num_tokens: int) -> None:
        """Give back the blocks of ``req`` that hold no slot below ``num_tokens`` (slots of
        rejected speculative tokens). They were allocated for this sequence alone and never
        registered, so they go to the head of the free list."""
        keep = -(-num_tokens // self.block_size)
        blocks = req.blocks
        if len(blocks) > keep:
            self.pool.free_blocks(reversed(blocks[keep:]))
            del blocks[keep:]
            del req.block_ids[keep:]

    def free(self, req: Request) -> None:
        """Release all of ``req``'s blocks, tail first (its tail is evicted before its head)."""
        if req.blocks:
            self.pool.free_blocks(reversed(req.blocks))
            req.blocks = []
            req.block_ids = []
        req.num_registered_blocks = 0

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the same block table as ``parent``, sharing every block."""
        assert not child.blocks
        child.blocks = list(parent.blocks)
        child.block_ids = list(parent.block_ids)
        self.pool.touch(child.blocks)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks

    def drain_copies(self) -> list[tuple[int, int]]:
        copies = self.pending_copies
        self.pending_copies = []
        return copies
