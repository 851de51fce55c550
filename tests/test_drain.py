"""Caps that drain: lowering max-num-seqs (or the token budget) under load never preempts;
running requests finish, admission waits, and greedy outputs stay those of a run without
the change (a real tiny Qwen3 in float32)."""

from __future__ import annotations

import time

import pytest

from pagectl.engine.commands import SetConfig
from pagectl.engine.llm import LLM
from pagectl.engine.sampling_params import SamplingParams
from pagectl.tui.connection import LIVE, Connection
from pagectl.tui.widgets.header import draining, render_header

NUM_REQUESTS = 36


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    engine = LLM(str(tiny_qwen3), dtype="float32", num_kv_blocks=512, max_num_seqs=32)
    yield engine
    engine.shutdown()


def run(llm: LLM, change: list[tuple[str, int]] | None, tag: str):
    """Submit the same greedy load; apply ``change`` once 32 sequences run. Returns (output
    ids by request, running count per step from the change on, preemptions, snapshots)."""
    core = llm.core
    for i in range(NUM_REQUESTS):
        prompt = [3 + (i * 7 + j) % 200 for j in range(4 + i % 5)]
        sp = SamplingParams(temperature=0.0, max_tokens=6 + (i * 5) % 13, ignore_eos=True)
        core.add_request(f"{tag}-{i}", prompt, sp)
    out: dict[str, list[int]] = {}
    after: list[int] = []
    snaps = []
    preempt0 = core.scheduler.counters.preemptions
    changed = change is None
    while core.has_unfinished():
        for o in core.step():
            out.setdefault(o.request_id.split("-")[1], []).extend(o.new_token_ids)
        if not changed and core.scheduler.num_running == 32:
            for name, value in change or []:
                core.apply_command(SetConfig(name, value), "test")
            changed = True
            snaps.append(core.snapshot())
        elif change is not None and changed:
            after.append(core.scheduler.num_running)
            if len(snaps) < 3:
                snaps.append(core.snapshot())
    return out, after, core.scheduler.counters.preemptions - preempt0, snaps


@pytest.mark.parametrize(
    "change",
    [[("max_num_seqs", 4)], [("max_num_seqs", 4), ("max_num_batched_tokens", 8)]],
    ids=["seqs-32-to-4", "seqs-and-budget"],
)
def test_lowering_the_caps_under_load_drains_without_preempting(llm, change):
    budget = llm.core.scheduler.config.max_num_batched_tokens
    reference, _, ref_preempt, _ = run(llm, None, "ref")
    assert ref_preempt == 0
    outputs, after, preemptions, snaps = run(llm, change, "drain")
    assert preemptions == 0
    assert outputs == reference  # token for token
    assert after[0] > 4  # the change found more running than the new cap
    # The running count only falls until it is under the cap, then stays under it.
    first_under = next(i for i, n in enumerate(after) if n <= 4)
    assert all(a >= b for a, b in zip(after[:first_under], after[1 : first_under + 1]))
    assert max(after[first_under:]) <= 4
    # The console reads the drain from the snapshot.
    assert draining(snaps[0]) == f"(draining to 4, now {snaps[0].num_running})"
    header = render_header(snaps[0], Connection(LIVE, "x", 0.1)).plain
    assert f"draining to 4, now {snaps[0].num_running}" in header
    config_events = [
        e for e in snaps[0].events if e.kind == "config" and e.data["name"] == "max_num_seqs"
    ]
    assert "(draining: 32 running)" in config_events[-1].message
    llm.core.apply_command(SetConfig("max_num_seqs", 32))
    llm.core.apply_command(SetConfig("max_num_batched_tokens", budget))


def test_ctl_set_drain_waits_until_the_cap_holds(tmp_path):
    """`ctl set max-num-seqs 2 --drain` against the real engine loop under load: it prints
    the count as it falls and returns once at most 2 run; nothing is preempted."""
    import subprocess
    import sys
    import threading

    from loop_harness import LoopThread

    engine = LoopThread(tmp_path, step_delay_s=0.01, num_kv_blocks=512).start()
    stop = threading.Event()

    def read_outputs() -> None:
        while not stop.is_set():
            engine.drain_outputs()
            stop.wait(0.02)

    reader = threading.Thread(target=read_outputs, daemon=True)
    try:
        for i in range(12):
            engine.submit([3 + i] * 8, max_tokens=40 + 10 * i)
        reader.start()
        deadline = time.monotonic() + 20
        while engine.core.scheduler.num_running < 12 and time.monotonic() < deadline:
            time.sleep(0.01)
        ep = engine.endpoints
        r = subprocess.run(
            [sys.executable, "-m", "pagectl", "ctl", "--control-endpoint", ep.control,
             "--token-file", ep.token_file, "set", "max-num-seqs", "2", "--drain"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0] == "max_num_seqs: 32 -> 2"
        assert lines[1].startswith("draining to 2 (now ")
        counts = [int(x.split("now ")[1].rstrip(")")) for x in lines[1:-1]]
        assert counts == sorted(counts, reverse=True) and counts[0] > 2
        assert lines[-1].startswith("drained: ") and int(lines[-1].split()[1]) <= 2
        assert engine.core.scheduler.counters.preemptions == 0
    finally:
        stop.set()
        engine.stop()
