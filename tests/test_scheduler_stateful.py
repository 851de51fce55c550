"""Property-based test: random add/step/abort/fork/toggle/config sequences on a tiny pool.

After every operation the KV bookkeeping invariants hold; at the end every block is free and
every request that was not aborted produced exactly the number of tokens it asked for.
"""

from __future__ import annotations

from collections import Counter

from fakes import FakeRunner
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagectl.engine.commands import ResetPrefixCache, SetConfig, SetPrefixCaching
from pagectl.engine.config import CacheConfig, SchedulerConfig
from pagectl.engine.core import EngineCore
from pagectl.engine.sampling_params import SamplingParams
from pagectl.engine.scheduler import Scheduler

BLOCK_SIZE = 4
NUM_BLOCKS = 12
PREFIXES = [[7, 7, 7, 7, 8, 8, 8, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42] * 5]


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        sched = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=16,
                max_num_seqs=6,
                max_model_len=NUM_BLOCKS * BLOCK_SIZE,
                long_prefill_token_threshold=0,
                policy="fcfs",
            ),
            CacheConfig(
                block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS, enable_prefix_caching=True
            ),
        )
        self.core = EngineCore(sched, FakeRunner(), vocab_size=100, eos_token_ids=[0])
        self.expected: dict[str, tuple[int, int]] = {}  # request_id -> (n, max_tokens)
        self.aborted: set[str] = set()
        self.tokens: dict[tuple[str, int], list[int]] = {}
        self.finish: dict[tuple[str, int], str] = {}
        self.next_id = 0

    def _collect(self, outputs) -> None:
        for o in outputs:
            key = (o.request_id, o.index)
            assert key not in self.finish, f"output after finish for {key}"
            self.tokens.setdefault(key, []).extend(o.new_token_ids)
            if o.finish_reason:
                self.finish[key] = o.finish_reason

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(10, 99), min_size=0, max_size=9),
        n=st.integers(1, 3),
        max_tokens=st.integers(1, 16),
        salt=st.sampled_from([None, None, "tenant"]),
        priority=st.integers(0, 2),
    )
    def add(self, prefix, tail, n, max_tokens, salt, priority):
        rid = f"r{self.next_id}"
        self.next_id += 1
        sp = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, temperature=0)
        self.core.add_request(rid, prefix + tail, sp, cache_salt=salt, priority=priority)
        self.expected[rid] = (n, max_tokens)

    @rule()
    def step(self):
        self._collect(self.core.step())

    @rule(k=st.integers(1, 8))
    def steps(self, k):
        for _ in range(k):
            self._collect(self.core.step())

    @precondition(lambda self: bool(self.core.scheduler.groups))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.core.scheduler.groups)))
        assert self.core.abort_request(rid)
        self.aborted.add(rid)

    @rule(on=st.booleans())
    def toggle_prefix_caching(self, on):
        self.core.apply_command(SetPrefixCaching(enabled=on))

    @rule()
    def reset_prefix_cache(self):
        self.core.apply_command(ResetPrefixCache())

    @rule(budget=st.integers(1, 40))
    def set_budget(self, budget):
        self.core.apply_command(SetConfig(name="max_num_batched_tokens", value=budget))

    @rule(cap=st.integers(1, 6))
    def set_max_seqs(self, cap):
        self.core.apply_command(SetConfig(name="max_num_seqs", value=cap))

    @rule(paused=st.booleans())
    def pause(self, paused):
        self.core.scheduler.set_paused(paused)

    @invariant()
    def kv_bookkeeping(self):
        sched = self.core.scheduler
        pool = sched.kv.pool
        live = list(sched.running)
        # Waiting sequences hold no blocks.
        assert all(not r.blocks for r in sched.waiting)
        holders = Counter(b.block_id for r in live for b in r.blocks)
        free_ids = pool.free_block_queue.ids()
        assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
        for b in pool.blocks:
            assert b.ref_cnt == holders.get(b.block_id, 0), b
            assert (b.ref_cnt == 0) == (b.block_id in set(free_ids))
            assert pool.ref_bytes[b.block_id] == min(b.ref_cnt, 255)
            assert pool.hashed_bytes[b.block_id] == (b.block_hash is not None)
        for h, b in pool.cached_blocks.items():
            assert b.block_hash == h
        assert pool.num_cached_free_blocks == sum(
            1 for b in pool.cached_blocks.values() if b.ref_cnt == 0
        )
        for r in live:
            assert [b.block_id for b in r.blocks] == r.block_ids
            assert len(r.blocks) * BLOCK_SIZE >= r.num_computed_tokens
            for i, b in enumerate(r.blocks[: r.num_computed_tokens // BLOCK_SIZE]):
                if b.block_hash is not None:
                    # The map only points at blocks holding exactly that content.
                    assert i < len(r.block_hashes) and b.block_hash == r.block_hashes[i]
                    assert (
                        list(b.token_ids) == r.all_token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
                    )

    def teardown(self):
        sched = self.core.scheduler
        sched.set_paused(False)
        for _ in range(2000):
            if not self.core.has_unfinished():
                break
            self._collect(self.core.step())
        assert not self.core.has_unfinished()
        pool = sched.kv.pool
        assert pool.num_free_blocks == NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        for rid, (n, max_tokens) in self.expected.items():
            if rid in self.aborted:
                continue
            for i in range(n):
                assert self.finish.get((rid, i)) == "length", (rid, i, self.finish.get((rid, i)))
                assert len(self.tokens[(rid, i)]) == max_tokens


EngineMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngineMachine = EngineMachine.TestCase
