"""Scheduler with a fake runner: budgets, chunking, preemption, priorities, live config."""

from __future__ import annotations

import pytest
from fakes import FakeRunner

from pagectl.engine.commands import Abort, CommandError, SetConfig, SetPrefixCaching
from pagectl.engine.config import CacheConfig, SchedulerConfig
from pagectl.engine.core import EngineCore
from pagectl.engine.sampling_params import SamplingParams
from pagectl.engine.scheduler import Scheduler

EOS = 3


def make_core(
    *,
    budget: int = 64,
    max_seqs: int = 16,
    blocks: int = 64,
    block_size: int = 4,
    policy: str = "fcfs",
    caching: bool = True,
    threshold: int = 0,
    runner: FakeRunner | None = None,
) -> EngineCore:
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            max_model_len=4096,
            policy=policy,
            long_prefill_token_threshold=threshold,
        ),
        CacheConfig(block_size=block_size, num_kv_blocks=blocks, enable_prefix_caching=caching),
    )
    return EngineCore(sched, runner or FakeRunner(), vocab_size=2000, eos_token_ids=[EOS])


def sp(max_tokens: int = 8, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run(core: EngineCore, max_steps: int = 10_000) -> dict:
    """Step to completion; returns {(request_id, index): (tokens, finish_reason, cached)}."""
    out: dict = {}
    for _ in range(max_steps):
        if not core.has_unfinished():
            break
        for o in core.step():
            toks, _, _ = out.get((o.request_id, o.index), ([], None, 0))
            out[(o.request_id, o.index)] = (
                toks + o.new_token_ids,
                o.finish_reason,
                o.num_cached_tokens,
            )
    else:
        raise AssertionError("did not finish")
    return out


def assert_no_leaks(core: EngineCore) -> None:
    pool = core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert bytes(pool.ref_bytes) == bytes(pool.num_blocks)


def test_chunked_prefill_respects_budget_exactly():
    runner = FakeRunner()
    core = make_core(budget=10, runner=runner)
    core.add_request("a", list(range(10, 35)), sp(3))  # 25 prompt tokens
    core.add_request("b", list(range(50, 57)), sp(3))  # 7 prompt tokens
    res = run(core)
    steps = [(tuple(r.seq_id for r in s.seqs), tuple(s.num_scheduled_tokens)) for s in runner.steps]
    assert steps[:5] == [
        (("a",), (10,)),
        (("a",), (10,)),
        (("a", "b"), (5, 5)),  # a's last chunk, b admitted with the rest of the budget
        (("a", "b"), (1, 2)),
        (("a", "b"), (1, 1)),
    ]
    assert all(s.total_num_scheduled_tokens <= 10 for s in runner.steps)
    c = core.scheduler.counters
    assert (
        c.scheduled_tokens
        == sum(s.total_num_scheduled_tokens for s in runner.steps)
        == 25 + 7 + 2 + 2
    )
    assert [len(res[("a", 0)][0]), len(res[("b", 0)][0])] == [3, 3]
    assert_no_leaks(core)


def test_long_prefill_threshold_lets_decodes_through():
    runner = FakeRunner()
    core = make_core(budget=64, threshold=8, runner=runner)
    core.add_request("short", [5, 6, 7], sp(20))
    core.add_request("long", list(range(100, 160)), sp(2))
    run(core)
    for s in runner.steps:
        assert all(n <= 8 for n in s.num_scheduled_tokens)
    # The short request decodes on every step while the long prompt is chunked.
    assert all("short" in [r.seq_id for r in s.seqs] for s in runner.steps[:8])


def test_preemption_under_pressure_and_same_output():
    ref = run(_pressure_core(blocks=200))
    core = _pressure_core(blocks=12)
    res = run(core)
    assert res == ref  # recompute after preemption yields the same tokens
    c = core.scheduler.counters
    assert c.preemptions > 0 and c.preemptions_by_reason == {"kv_blocks": c.preemptions}
    assert c.recomputed_tokens > 0
    kinds = [e.kind for e in core.scheduler.events]
    assert "preemption" in kinds
    ev = next(e for e in core.scheduler.events if e.kind == "preemption")
    assert ev.data["reason"] == "kv_blocks" and ev.data["tokens_lost"] > 0
    assert_no_leaks(core)


def _pressure_core(blocks: int) -> EngineCore:
    core = make_core(budget=64, blocks=blocks, block_size=4, caching=False)
    for i in range(4):
        core.add_request(f"r{i}", [i + 10] * 6, sp(14))
    return core


def test_victim_is_newest_under_fcfs():
    core = make_core(budget=64, blocks=7, block_size=4, caching=False)
    core.add_request("old", [10] * 7, sp(12))
    core.add_request("new", [20] * 7, sp(12))
    victims = []
    while core.has_unfinished():
        core.step()
        victims += [e.data["victim"] for e in core.scheduler.events if e.kind == "preemption"]
        core.scheduler.events.clear()
    assert victims and victims[0] == "new"


def test_priority_policy_orders_admission_and_picks_victim():
    runner = FakeRunner()
    core = make_core(budget=4, policy="priority", runner=runner, max_seqs=1)
    core.add_request("low", [10, 11, 12], sp(2), priority=5)
    core.add_request("high", [20, 21, 22], sp(2), priority=-1)
    core.add_request("mid", [30, 31, 32], sp(2), priority=0)
    core.add_request("mid2", [40, 41, 42], sp(2), priority=0)
    run(core)
    order = []
    for s in runner.steps:
        for r in s.seqs:
            if r.request_id not in order:
                order.append(r.request_id)
    assert order == ["high", "mid", "mid2", "low"]

    core = make_core(budget=64, policy="priority", blocks=7, block_size=4, caching=False)
    core.add_request("vip", [10] * 7, sp(12), priority=0)
    core.add_request("bulk", [20] * 7, sp(12), priority=9)
    core.step()
    core.step()
    victims = []
    while core.has_unfinished():
        core.step()
        victims += [e.data["victim"] for e in core.scheduler.events if e.kind == "preemption"]
        core.scheduler.events.clear()
    assert victims and set(victims) == {"bulk"}


def test_stop_conditions():
    core = make_core(
        runner=FakeRunner(lambda r: EOS if r.num_output_tokens >= 2 else 50 + r.num_output_tokens)
    )
    core.add_request("eos", [9, 9], SamplingParams(max_tokens=10, temperature=0))
    core.add_request("ignore", [9, 9], SamplingParams(max_tokens=5, ignore_eos=True, temperature=0))
    core.add_request("min", [9, 9], SamplingParams(max_tokens=10, min_tokens=4, temperature=0))
    res = run(core)
    assert res[("eos", 0)][:2] == ([50, 51, EOS], "stop")
    assert res[("ignore", 0)][:2] == ([50, 51, EOS, EOS, EOS], "length")
    assert res[("min", 0)][:2] == ([50, 51, EOS, EOS], "stop")  # EOS before 4 tokens ignored

    core = make_core(runner=FakeRunner(lambda r: 77 if r.num_output_tokens == 1 else 60))
    core.add_request("ids", [9], SamplingParams(max_tokens=10, stop_token_ids=[77], temperature=0))
    res = run(core)
    assert res[("ids", 0)][:2] == ([60, 77], "stop")


def test_abort_waiting_running_and_mid_chunk_frees_everything():
    core = make_core(budget=8, blocks=32, max_seqs=2)
    core.add_request("chunked", list(range(10, 40)), sp(5))
    core.add_request("run", [5, 6], sp(50))
    core.add_request("wait", [7, 8], sp(5))
    core.step()
    core.step()
    sched = core.scheduler
    assert sched.groups["chunked"][0].num_computed_tokens < 30  # mid-chunk
    assert core.abort_request("chunked")
    assert core.abort_request("wait")
    assert not core.abort_request("nope")
    outs = core.step()
    aborted = {o.request_id for o in outs if o.finish_reason == "abort"}
    assert aborted == {"chunked", "wait"}
    core.apply_command(Abort(request_id="run"))
    run(core)
    assert_no_leaks(core)
    assert sched.counters.finished_by_reason["abort"] == 3


def test_request_that_can_never_fit_finishes_with_error():
    core = make_core(blocks=4, block_size=4)
    core.add_request("huge", list(range(10, 40)), sp(4))  # 30 tokens > 16 slots
    core.add_request("ok", [1, 2, 3], sp(4))
    res = run(core)
    assert res[("huge", 0)][1] == "error"
    assert res[("ok", 0)][1] == "length" and len(res[("ok", 0)][0]) == 4
    assert any(e.kind == "error" for e in core.scheduler.events)
    # A request that outgrows the pool while decoding alone stops with "length".
    core = make_core(blocks=3, block_size=4)
    core.add_request("grows", [1, 2, 3], sp(30))
    res = run(core)
    # 12 slots hold 12 computed tokens; the last sampled token needs no slot of its own.
    assert res[("grows", 0)][1] == "length" and len(res[("grows", 0)][0]) == 12 - 3 + 1
    assert_no_leaks(core)


def test_prefix_cache_hits_and_recompute_not_counted():
    core = make_core(blocks=64, block_size=4)
    prompt = list(range(100, 118))  # 18 tokens: 4 full blocks
    core.add_request("a", prompt, sp(2))
    run(core)
    core.add_request("b", prompt, sp(2))
    res = run(core)
    assert res[("b", 0)][2] == 16
    c = core.scheduler.counters
    assert (c.prefix_queries, c.prefix_hits) == (36, 16)

    # Preempted requests re-admitted through the cache add nothing to the counters.
    core = make_core(budget=64, blocks=14, block_size=4)
    for i in range(3):
        core.add_request(f"r{i}", [i + 10] * 9, sp(16))
    run(core)
    c = core.scheduler.counters
    assert c.preemptions > 0
    assert c.prefix_queries == 27
    assert c.prefix_hits == 0


def test_parallel_sampling_forks_and_shares_prompt_blocks():
    runner = FakeRunner()
    core = make_core(blocks=64, block_size=4, runner=runner)
    core.add_request("p", list(range(10, 20)), sp(4, n=3))  # 10 tokens
    core.step()  # parent computes 9 tokens, then forks
    sched = core.scheduler
    seqs = sched.groups["p"]
    assert [s.index for s in seqs] == [0, 1, 2]
    assert all(s.block_ids == seqs[0].block_ids for s in seqs)
    assert [sched.kv.pool.blocks[b].ref_cnt for b in seqs[0].block_ids] == [3, 3, 3]
    first = core.step()  # each child feeds the last prompt token into a private copy of block 2
    assert runner.steps[-1].block_copies == [(2, 3), (2, 4)]
    assert sorted(o.index for o in first) == [0, 1, 2]
    assert [s.block_ids for s in seqs] == [[0, 1, 3], [0, 1, 4], [0, 1, 2]]
    assert [sched.kv.pool.blocks[b].ref_cnt for b in (0, 1)] == [3, 3]
    res = run(core)
    assert sorted(k for k in res) == [("p", 0), ("p", 1), ("p", 2)]
    assert all(len(v[0]) == 3 and v[1] == "length" for v in res.values())  # + 1 in ``first``
    assert res[("p", 0)][0] != res[("p", 1)][0]  # the fake model depends on the index
    assert_no_leaks(core)


def test_live_config_changes_take_effect_next_step():
    runner = FakeRunner()
    core = make_core(budget=16, runner=runner, max_seqs=8)
    for i in range(4):
        core.add_request(f"r{i}", list(range(10 + i, 40 + i)), sp(4))
    core.step()
    assert runner.steps[-1].total_num_scheduled_tokens == 16
    res = core.apply_command(SetConfig(name="max-num-batched-tokens", value="40"), client="t")
    assert res == {"name": "max_num_batched_tokens", "old": 16, "new": 40}
    core.step()
    assert runner.steps[-1].total_num_scheduled_tokens == 40
    ev = core.scheduler.events[-1]
    assert ev.kind == "config" and ev.data == {
        "name": "max_num_batched_tokens",
        "old": 16,
        "new": 40,
        "client": "t",
    }
    core.apply_command(SetConfig(name="max_num_seqs", value=1))
    run(core)
    # Lowering the cap does not preempt; admission waits until running drops below it.
    assert max(len(s.seqs) for s in runner.steps[-5:]) == 1
    for bad in [
        SetConfig(name="max_num_batched_tokens", value=0),
        SetConfig(name="max_num_batched_tokens", value="lots"),
        SetConfig(name="max_num_seqs", value=9),  # above the start-up value
        SetConfig(name="long_prefill_token_threshold", value=-1),
    ]:
        with pytest.raises(CommandError) as ei:
            core.apply_command(bad)
        assert ei.value.kind == "invalid_value"
    with pytest.raises(CommandError) as ei:
        core.apply_command(SetConfig(name="block_size", value=32))
    assert ei.value.kind == "unknown_setting"


def test_prefix_caching_off_at_runtime():
    core = make_core(blocks=64, block_size=4)
    prompt = list(range(100, 118))
    core.add_request("a", prompt, sp(2))
    run(core)
    assert core.scheduler.kv.pool.num_cached_free_blocks == 4
    core.apply_command(SetPrefixCaching(enabled=False))
    assert core.scheduler.kv.pool.cached_blocks == {}
    assert core.scheduler.kv.pool.num_cached_free_blocks == 0
    core.add_request("b", prompt, sp(2))
    assert run(core)[("b", 0)][2] == 0
    core.apply_command(SetPrefixCaching(enabled=True))
    core.add_request("c", prompt, sp(2))
    run(core)
    core.add_request("d", prompt, sp(2))
    assert run(core)[("d", 0)][2] == 16


def test_pause_stops_admission_only():
    runner = FakeRunner()
    core = make_core(runner=runner)
    core.add_request("a", [1, 2, 3], sp(6))
    core.step()
    core.scheduler.set_paused(True)
    core.add_request("b", [4, 5, 6], sp(2))
    for _ in range(3):
        core.step()
    assert {r.request_id for s in runner.steps for r in s.seqs} == {"a"}
    assert core.snapshot().engine_state == "paused"
    core.scheduler.set_paused(False)
    res = run(core)
    assert len(res[("b", 0)][0]) == 2


def test_validation_rejects_bad_requests_before_the_engine():
    core = make_core()
    with pytest.raises(ValueError, match="empty"):
        core.add_request("x", [], sp())
    with pytest.raises(ValueError, match="vocabulary"):
        core.add_request("x", [1, 2000], sp())
    with pytest.raises(ValueError, match="context"):
        core.add_request("x", [1] * 4090, sp(10))
    core.add_request("dup", [1], sp())
    with pytest.raises(ValueError, match="already"):
        core.add_request("dup", [1], sp())
    assert core.scheduler.counters.rejected == 4
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)


def test_snapshot_reports_blocks_requests_and_fragmentation():
    core = make_core(blocks=16, block_size=4)
    core.add_request("a", list(range(10, 20)), sp(8, n=2))
    core.add_request("b", list(range(10, 16)), sp(8))
    core.step()
    core.step()
    snap = core.snapshot()
    assert snap.blocks.num_blocks == 16 and len(snap.blocks.ref_counts) == 16
    used = [i for i, r in enumerate(snap.blocks.ref_counts) if r]
    assert len(used) == snap.num_used_blocks
    assert snap.num_used_token_slots < snap.num_used_blocks * 4  # partial last blocks
    rows = {(r.request_id, r.index): r for r in snap.requests}
    assert set(rows) == {("a", 0), ("a", 1), ("b", 0)}
    assert rows[("a", 1)].num_shared_blocks >= 2
    assert snap.counters.steps == 2
    from pagectl.engine.telemetry import decode_snapshot, encode_snapshot

    assert decode_snapshot(encode_snapshot(snap)) == snap


def test_finished_ids_reach_the_runner_even_after_idle_steps():
    runner = FakeRunner()
    core = make_core(runner=runner)
    core.add_request("a", [1, 2, 3], sp(50))
    core.step()
    core.abort_request("a")
    core.step()  # nothing to run: the runner is not called
    core.step()
    core.add_request("b", [4, 5], sp(1))
    core.step()
    assert runner.steps[-1].finished_seq_ids == ["a"]
