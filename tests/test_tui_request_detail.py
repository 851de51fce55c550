"""The request detail view and beam groups in the requests table, on the fake source; the
engine's ``inspect_request`` and the beam rows of its snapshot."""

from __future__ import annotations

import numpy as np
import pytest
from beam_scenario import BEAM_WIDTH, beam_snapshots
from test_tui_app import NOW, make_app, settle, text_of, wait_until
from test_tui_scenarios import busy_snapshots

from pagectl.engine.beam_search import BeamSearchParams
from pagectl.engine.commands import CommandError, InspectRequest
from pagectl.engine.inspect import MAX_INSPECT_TOKENS, clip
from pagectl.engine.sampling_params import SamplingParams
from pagectl.tui.blockmodel import block_ids, seq_id
from pagectl.tui.request_detail import render_tokens
from pagectl.tui.request_groups import GROUP_PREFIX, lines
from pagectl.tui.screens.request_detail import FETCH_TOKENS, RequestDetailScreen

SIZE = (80, 24)


class WordDetokenizer:
    """Token i reads "w<i>"; records what it decoded (the app runs it in a worker thread)."""

    error = ""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def decode(self, ids: list[int]) -> str:
        self.calls.append(list(ids))
        return " ".join(f"w{i}" for i in ids)


def spotlit(app) -> set[int] | None:
    """The block ids the block map lights, once the highlight has reached it."""
    ids = app.block_map._spotlight_ids
    return None if ids is None else set(ids.tolist())


def beam_app(**kw):
    snaps = beam_snapshots()
    app, src, clock = make_app(snaps, **kw)
    app.detokenizer = WordDetokenizer()
    return app, src, clock, snaps


async def open_detail(pilot, app, key: str) -> RequestDetailScreen:
    """Focus the table, put the cursor on the line ``key`` and press enter."""
    table = app.requests_table
    table.focus()
    await pilot.pause()
    table.move_cursor(row=list(table.lines_by_key).index(key), animate=False)
    await pilot.press("enter")
    assert await wait_until(pilot, lambda: isinstance(app.screen, RequestDetailScreen), 3.0)
    return app.screen


def tokens_shown(screen: RequestDetailScreen) -> bool:
    return screen.status == "ok" and screen.tokens is not None


# -- the requests table: groups and their children ----------------------------------------


def test_lines_group_beams_and_samples_under_their_request():
    snap = beam_snapshots()[-1]
    out = lines(snap.requests)
    kinds = [(ln.kind, ln.key) for ln in out]
    beams = [r for r in snap.requests if r.request_id == "beam"]
    assert len(beams) == BEAM_WIDTH and len({seq_id(r) for r in beams}) == BEAM_WIDTH
    assert kinds[0] == ("group", GROUP_PREFIX + "beam")
    # Beams best first under their group, then the lone request, then the n=2 group.
    children = [ln.row for ln in out[1 : 1 + BEAM_WIDTH]]
    assert [c.cum_logprob for c in children] == sorted((r.cum_logprob for r in beams), reverse=True)
    assert all(ln.kind == "child" for ln in out[1 : 1 + BEAM_WIDTH])
    assert kinds[1 + BEAM_WIDTH] == ("seq", "chat")
    assert kinds[2 + BEAM_WIDTH :] == [
        ("group", GROUP_PREFIX + "pair"),
        ("child", "pair"),
        ("child", "pair#1"),
    ]
    group = out[0]
    assert group.label == f"beam W={BEAM_WIDTH}" and out[BEAM_WIDTH].label.startswith("└")
    # The group's row: the distinct blocks of its beams, those held by 2+ of them shared.
    held = np.concatenate([block_ids(r) for r in beams])
    ids, counts = np.unique(held, return_counts=True)
    assert block_ids(group.row).tolist() == ids.tolist()
    assert group.row.num_blocks == len(ids) < len(held)  # the beams share blocks
    assert group.row.num_shared_blocks == int((counts > 1).sum()) > 0


def test_lines_sorted_keep_children_under_their_group():
    snap = beam_snapshots()[-1]
    out = lines(snap.requests, sort=lambda r: r.num_blocks, reverse=True)
    tops = [ln for ln in out if ln.kind != "child"]
    assert [t.row.num_blocks for t in tops] == sorted(
        (t.row.num_blocks for t in tops), reverse=True
    )
    for i, ln in enumerate(out):
        if ln.kind == "child":
            owner = next(o for o in reversed(out[:i]) if o.kind == "group")
            assert owner.row.request_id == ln.row.request_id


async def test_group_line_lights_every_beam_and_a_child_only_its_own():
    app, _, _, snaps = beam_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app, len(snaps))
        table = app.requests_table
        table.focus()
        await pilot.pause()
        assert table.selected_line.key == GROUP_PREFIX + "beam"
        beams = [r for r in snaps[-1].requests if r.request_id == "beam"]
        every = set(np.concatenate([block_ids(r) for r in beams]).tolist())
        assert await wait_until(pilot, lambda: spotlit(app) == every, 3.0), spotlit(app)
        await pilot.press("down")  # the best beam alone
        child = table.selected_line
        assert child.kind == "child"
        own = set(block_ids(child.row).tolist())
        assert await wait_until(pilot, lambda: spotlit(app) == own, 3.0), spotlit(app)
        assert set(block_ids(child.row).tolist()) < every


# -- the detail view -------------------------------------------------------------------------


async def test_enter_opens_the_detail_with_facts_and_text_then_ids_then_back():
    app, src, _, snaps = beam_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        screen = await open_detail(pilot, app, "chat")
        assert await wait_until(pilot, lambda: tokens_shown(screen), 3.0)
        assert src.sent[-1] == InspectRequest("chat", seq_id="", max_tokens=FETCH_TOKENS)
        row = next(r for r in snaps[-1].requests if r.request_id == "chat")
        facts = text_of(screen.facts_panel)
        assert facts.startswith("running · priority 0")
        assert f"prompt {row.num_prompt_tokens} tokens" in facts
        assert f"output {row.num_output_tokens}" in facts
        assert f"cached {row.num_cached_tokens}" in facts
        assert f"blocks {row.num_blocks} ({row.num_shared_blocks} shared)" in facts
        assert "preemptions 0" in facts and "age " in facts
        shown = text_of(screen.tokens_panel)
        # The fake source's ids (prompt i -> (7 i) % 1000), decoded in the console.
        prompt_text = " ".join(f"w{(i * 7) % 1000}" for i in range(row.num_prompt_tokens))
        assert prompt_text in shown and f"output · {row.num_output_tokens} tokens" in shown
        await pilot.press("i")
        ids = text_of(screen.tokens_panel)
        assert " ".join(str((i * 7) % 1000) for i in range(row.num_prompt_tokens)) in ids
        assert "w0 " not in ids
        await pilot.press("escape")
        assert await wait_until(pilot, lambda: not isinstance(app.screen, RequestDetailScreen))


async def test_beam_group_detail_lists_beams_and_each_beams_text():
    app, src, _, snaps = beam_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        screen = await open_detail(pilot, app, GROUP_PREFIX + "beam")
        assert await wait_until(pilot, lambda: tokens_shown(screen), 3.0)
        assert src.sent[-1] == InspectRequest("beam", seq_id="", max_tokens=FETCH_TOKENS)
        facts = text_of(screen.facts_panel)
        assert f"beam search, width {BEAM_WIDTH}, {BEAM_WIDTH} live beams" in facts
        beams = sorted(
            (r for r in snaps[-1].requests if r.request_id == "beam"), key=lambda r: -r.cum_logprob
        )
        for r in beams:
            suffix = seq_id(r)[len("beam") :] or "#0"
            assert f"{suffix} {r.cum_logprob:.2f}" in facts
        shown = text_of(screen.tokens_panel)
        for r in beams:
            assert f"{seq_id(r)} · {r.num_output_tokens} tokens · cum logprob" in shown


async def test_child_line_opens_that_sequence_only():
    app, src, _, snaps = beam_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        screen = await open_detail(pilot, app, "pair#1")
        assert await wait_until(pilot, lambda: tokens_shown(screen), 3.0)
        assert src.sent[-1] == InspectRequest("pair", seq_id="pair#1", max_tokens=FETCH_TOKENS)
        assert screen.facts_panel.border_title == "Request pair#1"
        shown = text_of(screen.tokens_panel)
        assert "output · " in shown and "more sequences" not in shown


async def test_detail_follows_snapshots_refetches_as_output_grows_and_marks_the_end():
    snaps = busy_snapshots()
    app, src, clock = make_app(snaps[:-1])
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps) - 1)
        screen = await open_detail(pilot, app, "chat-3")
        assert await wait_until(pilot, lambda: tokens_shown(screen), 3.0)
        asked = len(src.sent)
        # The output grew, but within a second of the last fetch: no new fetch yet.
        src.push(snaps[-1])
        await settle(pilot, app, len(snaps))
        assert len(src.sent) == asked
        row = next(r for r in snaps[-1].requests if r.request_id == "chat-3")
        assert f"output {row.num_output_tokens}" in text_of(screen.facts_panel)
        # A second later (the console's clock) the next snapshot brings a refresh.
        clock.t = NOW + 1.5
        src.push(snaps[-1], received_at=clock.t)
        await settle(pilot, app, len(snaps) + 1)
        assert await wait_until(pilot, lambda: len(src.sent) == asked + 1, 3.0)
        # The request leaves the telemetry: its last facts stay, marked.
        gone = snaps[-1]
        gone.requests = [r for r in gone.requests if r.request_id != "chat-3"]
        src.push(gone, received_at=clock.t)
        await settle(pilot, app, len(snaps) + 2)
        facts = text_of(screen.facts_panel)
        assert "last seen; finished or aborted since" in facts
        assert f"output {row.num_output_tokens}" in facts


async def test_read_only_detail_shows_facts_and_asks_nothing():
    snaps = busy_snapshots()
    app, src, _ = make_app(snaps, can_control=False, read_only_reason="no control token file")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        screen = await open_detail(pilot, app, "doc-2")
        await pilot.pause()
        assert src.sent == []
        assert "preempted" in text_of(screen.facts_panel)
        assert "preemptions 1" in text_of(screen.facts_panel)
        assert text_of(screen.tokens_panel) == (
            "Tokens need the control channel (no control token file)."
        )


async def test_detail_without_a_tokenizer_shows_ids_and_why():
    snaps = busy_snapshots()
    app, _, _ = make_app(snaps)

    class NoTokenizer:
        error = "no tokenizer path in the runtime file"

        def decode(self, ids):
            return None

    app.detokenizer = NoTokenizer()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        screen = await open_detail(pilot, app, "chat-3")
        assert await wait_until(pilot, lambda: tokens_shown(screen), 3.0)
        shown = text_of(screen.tokens_panel)
        assert shown.startswith("ids only: no tokenizer path in the runtime file")
        assert "0 7 14 21" in shown


async def test_a_refused_fetch_is_shown():
    snaps = busy_snapshots()

    def refuse(cmd):
        raise CommandError("not_found", "no live request with id 'chat-3'")

    app, _, _ = make_app(snaps, responder=refuse)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app, len(snaps))
        screen = await open_detail(pilot, app, "chat-3")
        assert await wait_until(pilot, lambda: screen.status != "pending", 3.0)
        assert "not_found: no live request with id 'chat-3'" in text_of(screen.tokens_panel)


def test_long_lists_show_head_and_tail_with_the_gap():
    result = {
        "num_prompt_tokens": 5000,
        "num_sequences": 1,
        "prompt": clip(list(range(5000)), 8),
        "sequences": [
            {
                "seq_id": "r",
                "num_output_tokens": 3,
                "cum_logprob": None,
                "output": clip([7, 8, 9], 8),
            }
        ],
    }
    assert result["prompt"] == {
        "token_ids": [0, 1, 2, 3, 4996, 4997, 4998, 4999],
        "gap_at": 4,
        "gap": 4992,
    }
    ids = render_tokens(result, "ok", True, True, "").plain
    assert "0 1 2 3 … 4,992 tokens not shown … 4996 4997 4998 4999" in ids
    result["prompt"]["text"] = ["head", "tail"]
    result["sequences"][0]["output"]["text"] = ["abc", ""]
    text = render_tokens(result, "ok", False, True, "").plain
    assert "head … 4,992 tokens not shown … tail" in text and "abc" in text


# -- the engine's side ------------------------------------------------------------------------


def _core():
    from beam_scenario import BLOCK_SIZE

    from pagectl.engine.config import CacheConfig, SchedulerConfig
    from pagectl.engine.core import EngineCore
    from pagectl.engine.scheduler import Scheduler
    from pagectl.testing.fake_engine import FakeExecutor

    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=512,
            max_num_seqs=8,
            max_model_len=8192,
            long_prefill_token_threshold=0,
            policy="fcfs",
        ),
        CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=1024, enable_prefix_caching=True),
    )
    return EngineCore(sched, FakeExecutor(2000), vocab_size=2000, eos_token_ids=[0])


def test_inspect_request_is_bounded_and_names_what_it_left_out():
    core = _core()
    prompt = [(i % 1900) + 5 for i in range(6000)]
    core.add_request("long", prompt, SamplingParams(max_tokens=50, ignore_eos=True, n=3))
    for _ in range(60):
        core.step()
    res = core.apply_command(InspectRequest("long", max_tokens=100))
    assert res["num_prompt_tokens"] == 6000 and res["num_sequences"] == 3
    p = res["prompt"]
    assert len(p["token_ids"]) == 100 and p["gap_at"] == 50 and p["gap"] == 5900
    assert p["token_ids"] == prompt[:50] + prompt[-50:]
    seqs = {s["seq_id"]: s for s in res["sequences"]}
    assert set(seqs) == {"long", "long#1", "long#2"}
    live = {r.seq_id: r for r in core.scheduler.groups["long"]}
    for sid, s in seqs.items():
        out = live[sid].output_token_ids
        assert s["num_output_tokens"] == len(out) > 0
        # 100 ids shared by 3 sequences (at least 32 each): a head and a tail of 33.
        assert s["output"] == clip(out, 33)
        assert len(out) > 33 and s["output"]["gap"] == len(out) - 33
    one = core.apply_command(InspectRequest("long", seq_id="long#2", max_tokens=4096))
    assert [s["seq_id"] for s in one["sequences"]] == ["long#2"] and one["num_sequences"] == 3
    assert one["sequences"][0]["output"]["token_ids"] == live["long#2"].output_token_ids
    assert one["prompt"]["token_ids"] == prompt[:2048] + prompt[-2048:]


@pytest.mark.parametrize(
    "cmd, kind",
    [
        (InspectRequest("nobody"), "not_found"),
        (InspectRequest("r", seq_id="r#9"), "not_found"),
        (InspectRequest("r", max_tokens=0), "invalid_value"),
        (InspectRequest("r", max_tokens=MAX_INSPECT_TOKENS + 1), "invalid_value"),
    ],
)
def test_inspect_request_refusals(cmd, kind):
    core = _core()
    core.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4))
    with pytest.raises(CommandError) as e:
        core.apply_command(cmd)
    assert e.value.kind == kind


def test_beam_rows_carry_seq_ids_width_and_logprobs():
    core = _core()
    core.add_beam_request("b", list(range(5, 40)), BeamSearchParams(beam_width=3, max_tokens=30))
    core.add_request("plain", [9, 9, 9], SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(6):
        core.step()
    rows = core.snapshot().requests
    beams = [r for r in rows if r.request_id == "b"]
    group = core.scheduler.beam_groups["b"]
    assert sorted(r.seq_id for r in beams) == sorted(b.seq_id for b in group.beams)
    assert len({r.seq_id for r in beams}) == 3 and any("#b" in r.seq_id for r in beams)
    assert all(r.beam_width == 3 and r.cum_logprob == group.cum[r.seq_id] for r in beams)
    plain = next(r for r in rows if r.request_id == "plain")
    assert plain.seq_id == "plain" and plain.beam_width == 0
    res = core.apply_command(InspectRequest("b"))
    assert res["beam_width"] == 3
    assert {s["seq_id"]: s["cum_logprob"] for s in res["sequences"]} == {
        b.seq_id: group.cum[b.seq_id] for b in group.beams
    }
