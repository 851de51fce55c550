"""The console over a fleet (``FleetSource``) of fake sources, driven by Textual's Pilot: a
row per member, switching with keys and clicks, commands to the selected member only, the
skew verdict; and which members ``pagectl top`` makes from runtime files and a router."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from test_skew_verdict import run_fleet, unrelated
from test_tui_app import Clock, settle, text_of, wait_answers, wait_until
from test_tui_scenarios import NOW, SYSTEM_PROMPT, Recorder, make_core

from pagectl.control.fleet import MemberSpec, fleet_members, host_port, plan_fleet
from pagectl.control.protocol import EngineEndpoints, RuntimeInfo
from pagectl.control.selection import Selector
from pagectl.engine.commands import SetPrefixCaching
from pagectl.tui.app import PagectlTop
from pagectl.tui.fake_source import FakeSource
from pagectl.tui.fleet_source import FleetSource, Member, MemberResolver
from pagectl.tui.history import History
from pagectl.tui.widgets.header import ConsoleHeader

SIZE = (160, 48)


def skewed_fleet(n: int = 2) -> dict[str, list]:
    """Pinned histories of ``n`` engines: engine 0 takes a hot prefix, the others a trickle."""
    recs = {f"engine {i}": Recorder(make_core(num_blocks=256 if i == 0 else 96)) for i in range(n)}

    def feed(k, label, rec):
        if label == "engine 0":
            rec.add(f"hot{k}", SYSTEM_PROMPT + [500 + k] * 3, max_tokens=60)
        elif k % 4 == 0:
            rec.add(f"cold{k}-{label[-1]}", unrelated(k + 10 * int(label[-1]), 20), max_tokens=40)

    run_fleet(recs, feed, 12)
    return {label: rec.pinned() for label, rec in recs.items()}


def make_fleet(histories: dict[str, list], unreachable: dict[str, str] | None = None, **kw):
    """A ``PagectlTop`` over fake sources, one per member, each fed its whole history."""
    clock = Clock()
    members = []
    for label, snaps in histories.items():
        src = FakeSource(clock=clock, label=f"fake://{label.replace(' ', '')}", **kw)
        for s in snaps:
            src.push(s)
        members.append(Member(label, src))
    for label, why in (unreachable or {}).items():
        members.append(Member(label, None, why))
    fleet = FleetSource(members, clock=clock)
    return PagectlTop(fleet, clock=clock), fleet, clock


async def primed(fleet: FleetSource, histories) -> None:
    """Start the fleet before the app does and let it take every member's history in, so
    that the app is handed each member's newest frame only (a live subscriber conflates;
    a fake source would otherwise hand the app every frame, one at a time)."""
    await fleet.start()
    for _ in range(500):
        if all(len(m.history) >= len(histories[m.label]) for m in fleet.members if m.source):
            return
        await asyncio.sleep(0.01)


async def settle_fleet(pilot, app: PagectlTop, fleet: FleetSource, histories) -> None:
    """Every member's history taken in, and the selected one shown."""
    want = {label: len(snaps) for label, snaps in histories.items()}
    await wait_until(
        pilot,
        lambda: all(
            m.last_frame is not None and len(m.history) >= min(want[m.label], 61)
            for m in fleet.members
            if m.source is not None
        ),
    )
    await settle(pilot, app, 1)
    if fleet.member.history:  # the panels show the selected member's newest snapshot
        newest = fleet.member.history[-1].time
        assert await wait_until(
            pilot, lambda: app.snapshot is not None and app.snapshot.time == newest
        )
    app.fleet_table.show()
    await pilot.pause()


def request_ids(app: PagectlTop) -> set[str]:
    return {r.request_id for r in app.snapshot.requests} if app.snapshot else set()


async def test_two_engines_a_row_each_and_switching_with_keys():
    h = skewed_fleet(2)
    app, fleet, _ = make_fleet(h)
    await primed(fleet, h)
    async with app.run_test(size=SIZE) as pilot:
        await settle_fleet(pilot, app, fleet, h)
        table = text_of(app.fleet_table)
        lines = table.splitlines()
        assert lines[0].split()[:3] == ["member", "state", "run"]
        assert lines[1].startswith("▶1  engine 0") and lines[2].startswith(" 2  engine 1")
        hot = lines[1].split()
        # running, waiting, KV%, hit rate (rolling), tok/s, preemptions of engine 0.
        last = h["engine 0"][-1]
        assert hot[3:6] == ["running", str(last.num_running), str(last.num_waiting)]
        assert hot[6] == f"{100 * last.num_used_blocks / last.blocks.num_blocks:.0f}%"
        assert request_ids(app) == {r.request_id for r in last.requests}
        assert "[1/2] engine 0" in text_of(app.query_one(ConsoleHeader))

        await pilot.press("n")
        assert await wait_until(pilot, lambda: request_ids(app) and "hot0" not in request_ids(app))
        assert fleet.selected == 1
        assert request_ids(app) == {r.request_id for r in h["engine 1"][-1].requests}
        assert "[2/2] engine 1" in text_of(app.query_one(ConsoleHeader))
        assert text_of(app.fleet_table).splitlines()[2].startswith("▶2  engine 1")
        assert any("── now showing engine 1 ──" in x for x in app.event_log.lines_text())
        # The panels' history is engine 1's alone: the sparklines restarted from the minute
        # the fleet kept of it (engine 0's hot-prefix rates are gone).
        kept = History()
        for snap in fleet.members[1].history:
            kept.update(snap)
        assert len(kept.samples) > 1
        assert [x.time for x in app.history.samples] == [x.time for x in kept.samples]
        assert [x.generation_tps for x in app.history.samples] == [
            x.generation_tps for x in kept.samples
        ]

        # A command goes to the member shown, and to no other.
        await pilot.press("p")
        await wait_answers(pilot, app, 1)
        a, b = (m.source for m in fleet.members)
        assert b.sent == [SetPrefixCaching(enabled=False)] and a.sent == []

        await pilot.press("1")
        assert await wait_until(pilot, lambda: "hot0" in request_ids(app))
        assert fleet.selected == 0
        await pilot.press("N")  # previous, wrapping round
        assert await wait_until(pilot, lambda: fleet.selected == 1)


async def test_a_member_that_cannot_start_leaves_the_others():
    class Broken(FakeSource):
        async def start(self) -> None:
            raise OSError("no such socket")

    ok = FakeSource(clock=Clock())
    fleet = FleetSource([Member("a", Broken()), Member("b", ok)])
    await fleet.start()
    try:
        assert fleet.members[0].source is None and "cannot start: no such socket" in fleet.detail
        assert ok.started and [r.link for r in fleet.rows()] == ["unreachable", "connecting"]
    finally:
        await fleet.close()


async def test_three_members_one_remote_and_the_skew_verdict():
    h = skewed_fleet(2)
    why = "on another host: the admin channel is local, run pagectl top there"
    app, fleet, clock = make_fleet(h, unreachable={"10.1.2.3:8000": why})
    await primed(fleet, h)
    async with app.run_test(size=SIZE) as pilot:
        await settle_fleet(pilot, app, fleet, h)
        lines = text_of(app.fleet_table).splitlines()
        assert len(fleet.members) == 3
        assert lines[3].startswith(" 3  10.1.2.3:8000") and "no admin" in lines[3]
        assert why in lines[3]
        verdict = "\n".join(lines[4:])
        assert verdict.startswith(" ▲  engine 0 is hot: ") and "a hot prefix" in verdict
        assert app.fleet_table.verdict.member == "engine 0"

        await pilot.press("3")  # the remote one: no telemetry, no commands, and why
        await wait_until(pilot, lambda: fleet.selected == 2)
        await pilot.pause()
        assert not app.control_ready and app.snapshot is None
        assert app.check_action("toggle_prefix_caching", ()) is None
        assert why in app.link.detail

        # A member whose telemetry stops goes stale in its row and leaves the verdict.
        clock.t = NOW + 10.0
        app.fleet_table.show()
        await pilot.pause()
        assert "stale" in text_of(app.fleet_table).splitlines()[1]
        assert app.fleet_table.verdict is None


async def test_a_click_on_a_row_selects_it_and_one_source_has_no_fleet_keys():
    h = skewed_fleet(3)
    app, fleet, _ = make_fleet(h)
    await primed(fleet, h)
    async with app.run_test(size=SIZE) as pilot:
        await settle_fleet(pilot, app, fleet, h)
        await pilot.click("#fleet", offset=(5, 3))  # the third row
        assert await wait_until(pilot, lambda: fleet.selected == 2)
        await wait_until(pilot, lambda: "cold0-2" in request_ids(app) or not request_ids(app))
        assert "[3/3] engine 2" in text_of(app.query_one(ConsoleHeader))

    one = PagectlTop(FakeSource(clock=Clock()), clock=Clock())
    async with one.run_test(size=SIZE) as pilot:
        assert one.fleet_table is None and not one.query("#fleet")
        assert one.check_action("member", (1,)) is False
        await pilot.press("n")  # nothing to switch to, nothing breaks


# -- which members: runtime files, DP engines, a router ------------------------------------


def write_runtime(base, pid: int, url: str, engines: int = 0) -> RuntimeInfo:
    """A runtime file as a daemon writes it (``pid`` must be alive: this process's)."""
    d = base / str(pid)
    d.mkdir()
    eps = [
        EngineEndpoints(
            index=i,
            telemetry_endpoint=f"ipc://{d}/tel{i}.sock",
            control_endpoint=f"ipc://{d}/ctl{i}.sock",
        )
        for i in range(engines)
    ]
    info = RuntimeInfo(
        pid=pid,
        start_time=NOW + len(list(base.glob("*/runtime.json"))),
        model="m",
        http_url=url,
        telemetry_endpoint=f"ipc://{d}/tel.sock",
        control_endpoint=f"ipc://{d}/ctl.sock",
        token_file=str(d / "token"),
        engines=eps,
    )
    (d / "runtime.json").write_bytes(msgspec.json.encode(info))
    return info


@pytest.fixture
def runtime_dir(tmp_path):
    import os

    base = tmp_path / "rt"
    base.mkdir()
    # Two daemons in one directory need two pid directories: this process and its parent.
    write_runtime(base, os.getpid(), "http://127.0.0.1:8101")
    write_runtime(base, os.getppid(), "http://127.0.0.1:8102", engines=2)
    return base


def test_members_from_urls_engines_and_a_router(runtime_dir):
    rt = str(runtime_dir)
    no_router = lambda url: None  # noqa: E731
    plain, dp = "http://127.0.0.1:8101", "http://127.0.0.1:8102"
    assert fleet_members(rt, [plain, dp], no_router) == [
        MemberSpec("127.0.0.1:8101", plain),
        MemberSpec("127.0.0.1:8102 engine 0", dp, 0),
        MemberSpec("127.0.0.1:8102 engine 1", dp, 1),
    ]
    # One daemon with two engines: the engines are the fleet; one engine: no fleet.
    assert [m.label for m in plan_fleet(rt, Selector(url=dp), [dp], no_router)] == [
        "engine 0",
        "engine 1",
    ]
    assert plan_fleet(rt, Selector(url=plain), [plain], no_router) is None
    assert plan_fleet(rt, Selector(port=8102), [], no_router)[1].engine == 1
    # A router: its local backends attach, a remote one and an unknown local one do not.
    backends = [plain, "http://10.9.8.7:8000", "http://127.0.0.1:8199"]
    router = "http://127.0.0.1:8080"
    specs = plan_fleet(rt, Selector(url=router), [router], lambda u: backends)
    assert [(m.label, bool(m.unreachable)) for m in specs] == [
        ("127.0.0.1:8101", False),
        ("10.9.8.7:8000", True),
        ("127.0.0.1:8199", True),
    ]
    assert "another host" in specs[1].unreachable and "runtime file" in specs[2].unreachable
    # A URL that is neither: one member that attaches once its daemon appears.
    assert plan_fleet(rt, Selector(url=router), [router], no_router) is None
    assert fleet_members(rt, [router, plain], no_router)[0] == MemberSpec("127.0.0.1:8080", router)
    # Each member re-reads its runtime file: engine 1's own endpoints.
    ep = MemberResolver(rt, MemberSpec("e1", dp, 1))()
    assert ep.telemetry.endswith("tel1.sock") and ep.control.endswith("ctl1.sock")
    assert host_port("http://[::1]:9000") == "[::1]:9000"


async def test_a_data_parallel_daemon_over_real_engine_loops(tmp_path):
    """A runtime file listing two engines (each a real ``EngineLoop`` with its own admin
    sockets): ``pagectl top`` shows an engine a row, and a command reaches the one shown."""
    import os

    from loop_harness import LoopThread
    from test_tui_app import wait_answers as answered

    from pagectl.cli import build_parser
    from pagectl.cli.top import build_source
    from pagectl.tui.connection import LIVE

    engines = []
    for i, blocks in enumerate((96, 64)):
        (tmp_path / f"e{i}").mkdir()
        engines.append(LoopThread(tmp_path / f"e{i}", num_kv_blocks=blocks).start())
    try:
        rt = tmp_path / "rt"
        (rt / str(os.getpid())).mkdir(parents=True)
        eps = [e.endpoints for e in engines]
        info = RuntimeInfo(
            pid=os.getpid(),
            start_time=NOW,
            model="m",
            http_url="http://127.0.0.1:8123",
            telemetry_endpoint=eps[0].telemetry,
            control_endpoint=eps[0].control or "",
            token_file=eps[0].token_file or "",
            engines=[
                EngineEndpoints(index=i, telemetry_endpoint=e.telemetry, control_endpoint=e.control)
                for i, e in enumerate(eps)
            ],
        )
        (rt / str(os.getpid()) / "runtime.json").write_bytes(msgspec.json.encode(info))
        argv = ["top", "--runtime-dir", str(rt)]
        source, chooser = build_source(build_parser(argv).parse_args(argv))
        assert isinstance(source, FleetSource) and chooser is None
        assert [m.label for m in source.members] == ["engine 0", "engine 1"]
        app = PagectlTop(source)

        def shown(blocks: int) -> bool:
            return app.snapshot is not None and app.snapshot.blocks.num_blocks == blocks

        async with app.run_test(size=SIZE) as pilot:
            assert await wait_until(pilot, lambda: all(r.link == LIVE for r in source.rows()), 15)
            assert await wait_until(pilot, lambda: shown(96), 10)
            await pilot.press("n")
            assert await wait_until(pilot, lambda: shown(64) and app.control_ready, 10)
            assert "[2/2] engine 1 · http://127.0.0.1:8123" in text_of(app.query_one(ConsoleHeader))
            await pilot.press("p")
            await answered(pilot, app, 1)
            assert app.answers[-1][1], app.answers
        assert engines[1].core.live_config()["enable_prefix_caching"] is False
        assert engines[0].core.live_config()["enable_prefix_caching"] is True
    finally:
        for e in engines:
            e.stop()
