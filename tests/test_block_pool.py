"""Block pool and KV cache manager: exact block ids, refcounts and eviction order."""

from __future__ import annotations

import pytest

from pagectl.engine.kv.block_pool import BlockPool
from pagectl.engine.kv.hashing import ROOT_HASH, hash_block_tokens, hash_request_blocks
from pagectl.engine.kv.manager import KVCacheManager
from pagectl.engine.request import Request
from pagectl.engine.sampling_params import SamplingParams

SP = SamplingParams(max_tokens=8, ignore_eos=True)


def req(rid: str, tokens: list[int], salt: str | None = None, n: int = 1) -> Request:
    return Request(rid, tokens, SP.clone(n=n), cache_salt=salt)


def refs(pool: BlockPool) -> list[int]:
    return [b.ref_cnt for b in pool.blocks]


def test_new_pool_hands_out_blocks_in_id_order():
    pool = BlockPool(6, 4)
    assert pool.free_block_queue.ids() == [0, 1, 2, 3, 4, 5]
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert refs(pool) == [1, 1, 1, 0, 0, 0]
    assert pool.num_free_blocks == 3
    assert bytes(pool.ref_bytes) == bytes([1, 1, 1, 0, 0, 0])
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)


def test_free_order_unhashed_to_head_hashed_to_tail_lru():
    pool = BlockPool(6, 4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, b"h-a", (1, 2, 3, 4))
    pool.cache_block(b, b"h-b", (5, 6, 7, 8))
    # Free tail first, as a request does: c (unhashed) goes to the head, b and a to the tail.
    pool.free_blocks([c, b, a])
    assert pool.free_block_queue.ids() == [2, 3, 4, 5, 1, 0]
    assert pool.num_cached_free_blocks == 2
    # New blocks come from the head: unhashed first, then never-used, then the LRU cached one.
    got = pool.get_new_blocks(5)
    assert [x.block_id for x in got] == [2, 3, 4, 5, 1]
    # Block 1 was evicted: its hash left the map; block 0 is still findable.
    assert pool.get_cached_block(b"h-b") is None
    assert pool.get_cached_block(b"h-a") is a
    assert b.block_hash is None and a.block_hash == b"h-a"
    assert pool.num_evictions == 1
    assert pool.num_cached_free_blocks == 1


def test_touch_revives_a_cached_free_block():
    pool = BlockPool(4, 4)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, b"h", (1, 2, 3, 4))
    pool.free_blocks([a])
    assert pool.num_free_blocks == 4 and pool.num_cached_free_blocks == 1
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 3 and pool.num_cached_free_blocks == 0
    assert 0 not in pool.free_block_queue.ids()
    pool.touch([a])
    assert a.ref_cnt == 2 and pool.ref_bytes[0] == 2


def test_duplicate_content_keeps_first_block_registered():
    pool = BlockPool(4, 4)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, b"same", (1, 2, 3, 4))
    assert not pool.cache_block(b, b"same", (1, 2, 3, 4))
    assert pool.cached_blocks == {b"same": a} and b.block_hash is None


def test_reset_prefix_cache_releases_only_unused_cached_blocks():
    pool = BlockPool(4, 4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"a", (1,) * 4)
    pool.cache_block(b, b"b", (2,) * 4)
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() == 1
    assert pool.cached_blocks == {} and a.block_hash is None and b.block_hash is None
    assert a.ref_cnt == 1  # the running owner keeps its block
    assert pool.free_block_queue.ids()[0] == 1  # released block moved to the head
    assert pool.num_cached_free_blocks == 0 and bytes(pool.hashed_bytes) == bytes(4)


def test_chained_hash_depends_on_whole_prefix_and_salt():
    h1 = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert h1 != hash_block_tokens(ROOT_HASH, [1, 2, 3, 5])
    assert hash_block_tokens(h1, [9, 9, 9, 9]) != hash_block_tokens(ROOT_HASH, [9, 9, 9, 9])
    a = hash_request_blocks(list(range(12)), 4, [])
    b = hash_request_blocks(list(range(12)), 4, [], cache_salt="tenant-b")
    assert len(a) == 3 and all(x != y for x, y in zip(a, b))
    assert hash_request_blocks(list(range(11)), 4, []) == a[:2]  # partial blocks are not hashed


def _run_prefill(kv: KVCacheManager, r: Request) -> None:
    hits = kv.find_cached_prefix(r)
    r.num_computed_tokens = 0
    assert kv.allocate_slots(r, r.num_tokens - len(hits) * kv.block_size, hits)
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)


def test_prefix_hits_across_requests_capped_below_prompt_length():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", list(range(100, 110)))  # 2 full blocks + 2 tokens
    _run_prefill(kv, a)
    assert a.block_ids == [0, 1, 2]
    assert len(kv.pool.cached_blocks) == 2
    # Same first 8 tokens, then different: hits exactly blocks 0 and 1.
    b = req("b", list(range(100, 108)) + [1, 2, 3])
    hits = kv.find_cached_prefix(b)
    assert [h.block_id for h in hits] == [0, 1]
    assert kv.allocate_slots(b, 3, hits)
    assert b.block_ids == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    # A prompt of exactly 8 matching tokens can hit only 1 block: its last token must be computed.
    c = req("c", list(range(100, 108)))
    assert [h.block_id for h in kv.find_cached_prefix(c)] == [0]


def test_salted_requests_never_share():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", list(range(9)), salt="alice")
    _run_prefill(kv, a)
    assert kv.find_cached_prefix(req("b", list(range(9)), salt="bob")) == []
    assert kv.find_cached_prefix(req("c", list(range(9)))) == []
    assert len(kv.find_cached_prefix(req("d", list(range(9)), salt="alice"))) == 2


def test_free_releases_tail_first_and_keeps_prefix_findable():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(13)))  # blocks 0..3, the last partial
    _run_prefill(kv, a)
    kv.free(a)
    # Unhashed partial block 3 to the head; hashed 2, 1, 0 to the tail in that order.
    assert kv.pool.free_block_queue.ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    b = req("b", list(range(13)))
    assert [h.block_id for h in kv.find_cached_prefix(b)] == [0, 1, 2]


def test_fork_shares_blocks_and_copy_on_write_gives_private_copies():
    kv = KVCacheManager(num_blocks=12, block_size=4)
    parent = req("p", list(range(10)), n=3)
    assert kv.allocate_slots(parent, 9)  # all but the last prompt token: blocks 0, 1, 2
    parent.num_computed_tokens = 9
    kids = [req("p", list(range(10))) for _ in range(2)]
    for k in kids:
        kv.fork(parent, k)
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [3, 3, 3]
    # Each sequence writes slot 9, inside shared block 2: the first two get private copies.
    assert kv.allocate_slots(parent, 1)
    assert kv.allocate_slots(kids[0], 1)
    assert kv.allocate_slots(kids[1], 1)
    assert kv.drain_copies() == [(2, 3), (2, 4)]
    assert parent.block_ids == [0, 1, 3]
    assert kids[0].block_ids == [0, 1, 4]
    assert kids[1].block_ids == [0, 1, 2]  # last holder writes in place
    assert [kv.pool.blocks[i].ref_cnt for i in range(5)] == [3, 3, 1, 1, 1]
    # Children finishing drop the shared refcounts back.
    kv.free(kids[0])
    kv.free(kids[1])
    assert [kv.pool.blocks[i].ref_cnt for i in range(5)] == [1, 1, 0, 1, 0]
    kv.free(parent)
    assert kv.num_free_blocks == 12


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r = req("a", list(range(20)))
    assert not kv.allocate_slots(r, 20)
    assert r.block_ids == [] and kv.num_free_blocks == 3
    assert kv.allocate_slots(r, 12)
    assert r.block_ids == [0, 1, 2]
