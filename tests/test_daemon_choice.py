"""Choosing a daemon: two real daemons (fake model) in one runtime directory, reached by
``ctl --port/--url/--pid`` and ``top --url``, ``ctl`` refusing to guess, ``pagectl ls``, the
console's picker, and stale runtime files cleaned."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import msgspec
import pytest
from test_tui_app import wait_until
from textual.widgets import OptionList

from pagectl.control.protocol import RuntimeInfo
from pagectl.control.runtime import live_runtimes, remove_stale_runtimes
from pagectl.control.selection import (
    AmbiguousRuntime,
    Selector,
    select_runtime,
    url_matches,
)
from pagectl.testing.daemon_process import DaemonProcess
from pagectl.tui.app import PagectlTop
from pagectl.tui.connection import LIVE
from pagectl.tui.daemon_choice import SelectingResolver
from pagectl.tui.screens.picker import DaemonPicker
from pagectl.tui.widgets.header import ConsoleHeader
from pagectl.tui.zmq_source import ZmqSource

FAKE = ["--engine-factory", "pagectl.testing.fake_engine:fake_engine", "--num-kv-blocks", "64"]


@pytest.fixture(scope="module")
def two(tmp_path_factory, tok_dir):
    rt = tmp_path_factory.mktemp("rt")
    daemons = [
        DaemonProcess(rt, ["--model", str(tok_dir), "--served-model-name", name, *FAKE])
        for name in ("alpha", "beta")
    ]
    try:
        for d in daemons:  # both start at once: start-up is most of this module's time
            d.launch()
        for d in daemons:
            d.wait_ready()
        yield daemons
    finally:
        for d in daemons:
            d.kill()


def model_of(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["model"]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def write_runtime(d, pid: int, port: int, start: float = 1.0) -> None:
    d.mkdir(parents=True, mode=0o700)
    info = RuntimeInfo(
        pid=pid,
        start_time=start,
        model=f"m{port}",
        http_url=f"http://0.0.0.0:{port}",
        telemetry_endpoint="ipc:///nowhere/t",
        control_endpoint="ipc:///nowhere/c",
        token_file=str(d / "control.token"),
    )
    (d / "runtime.json").write_bytes(msgspec.json.encode(info))


# -- selection rules (no daemon) ------------------------------------------------------------


def test_url_matching():
    assert url_matches("http://127.0.0.1:8000", "http://0.0.0.0:8000")
    assert url_matches("localhost:8000", "http://127.0.0.1:8000")
    assert not url_matches("http://127.0.0.1:8001", "http://127.0.0.1:8000")
    assert not url_matches("http://10.0.0.2:8000", "http://10.0.0.3:8000")


def test_select_and_clean_up_from_runtime_files(tmp_path):
    me, gone = os.getpid(), dead_pid()
    write_runtime(tmp_path / str(me), me, 8000, start=2.0)
    write_runtime(tmp_path / str(gone), gone, 8001)
    (tmp_path / "notes").mkdir()  # not a daemon's directory: never touched
    assert [i.pid for i in live_runtimes(tmp_path)] == [me]
    assert select_runtime(tmp_path).pid == me  # one live daemon: no selector needed
    with pytest.raises(FileNotFoundError, match="matches --port 8001"):
        select_runtime(tmp_path, Selector(port=8001))  # the dead one is not reachable
    assert remove_stale_runtimes(tmp_path) == [tmp_path / str(gone)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([str(me), "notes"])


# -- two daemons ----------------------------------------------------------------------------


@pytest.mark.slow
def test_ctl_reaches_the_chosen_daemon_and_refuses_to_guess(two):
    alpha, beta = two
    assert model_of(alpha.ctl("status", "--json")) == "alpha"  # DaemonProcess.ctl: --port
    assert model_of(beta.ctl("status", "--json")) == "beta"
    rt = str(alpha.runtime_dir)
    ctl = ("ctl", "--runtime-dir", rt)
    assert model_of(alpha.pagectl(*ctl, "--url", beta.base_url, "status", "--json")) == "beta"
    assert model_of(alpha.pagectl(*ctl, "--pid", str(alpha.proc.pid), "status", "--json")) == (
        "alpha"
    )
    r = alpha.pagectl(*ctl, "status")
    assert r.returncode == 2 and r.stdout == ""
    assert "2 daemons" in r.stderr and "--port" in r.stderr
    assert alpha.base_url in r.stderr and beta.base_url in r.stderr
    r = alpha.pagectl(*ctl, "--port", "1", "status")
    assert r.returncode == 3 and "matches --port 1" in r.stderr
    # The verdicts over a short look at the telemetry: an idle daemon needs no change.
    r = alpha.ctl("status", "--window", "2.5")
    assert r.returncode == 0 and "verdicts  none over the last 2.5s" in r.stdout
    assert json.loads(alpha.ctl("status", "--json", "--window", "2.5").stdout)["verdicts"] == []


@pytest.mark.slow
def test_ls_lists_both_and_removes_stale_runtime_files(two):
    alpha, beta = two
    gone = dead_pid()
    write_runtime(alpha.runtime_dir / str(gone), gone, 9)
    r = alpha.pagectl("ls", "--runtime-dir", str(alpha.runtime_dir))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["PID", "MODEL", "HTTP", "URL", "TP", "UPTIME", "STATE"]
    rows = {ln.split()[0]: ln.split() for ln in lines[1:]}
    assert rows[str(alpha.proc.pid)][1:4] == ["alpha", alpha.base_url, "1"]
    assert rows[str(beta.proc.pid)][1:4] == ["beta", beta.base_url, "1"]
    assert all(row[-1] == "running" for row in rows.values())
    assert f"dead daemon {gone}" in r.stderr
    assert not (alpha.runtime_dir / str(gone)).exists()
    r = alpha.pagectl("ctl", "--runtime-dir", str(alpha.runtime_dir), "ls", "--json")
    assert {json.loads(ln)["model"] for ln in r.stdout.splitlines()} == {"alpha", "beta"}


@pytest.mark.slow
async def test_top_url_attaches_to_the_chosen_daemon_and_shows_its_url(two):
    alpha, beta = two
    chooser = SelectingResolver(str(alpha.runtime_dir), Selector(url=beta.base_url))
    app = PagectlTop(ZmqSource(chooser), chooser=chooser)
    async with app.run_test(size=(160, 48)) as pilot:
        assert await wait_until(pilot, lambda: app.link.state == LIVE, 20)
        assert app.snapshot.model.model == "beta"
        header = app.query_one(ConsoleHeader).render()
        assert beta.base_url in str(getattr(header, "plain", header))


@pytest.mark.slow
async def test_top_without_a_selector_opens_a_picker(two):
    alpha, beta = two
    chooser = SelectingResolver(str(alpha.runtime_dir))
    with pytest.raises(AmbiguousRuntime):
        chooser()
    app = PagectlTop(ZmqSource(chooser), chooser=chooser)
    async with app.run_test(size=(120, 40)) as pilot:
        assert await wait_until(pilot, lambda: isinstance(app.screen, DaemonPicker))
        picker = app.screen
        assert isinstance(picker, DaemonPicker)
        # Keys go to the list once it is mounted, focused and has its first line highlighted.
        assert await wait_until(pilot, lambda: _list_ready(picker))
        assert app.link.state != LIVE  # nothing attached before the operator picks
        # The picker lists the daemons oldest first: by when each became ready, which for
        # two daemons launched together is either order. Move to beta's line and attach.
        models = [info.model for info in picker.choices]
        assert sorted(models) == ["alpha", "beta"]
        await pilot.press(*["down"] * models.index("beta"), "enter")
        assert await wait_until(pilot, lambda: app.link.state == LIVE, 20)
        assert app.snapshot.model.model == "beta"
        assert chooser.selector == Selector(url=beta.base_url)


def _list_ready(picker: DaemonPicker) -> bool:
    if not picker.is_mounted:
        return False
    options = picker.query(OptionList)
    return bool(options) and options.first().has_focus and options.first().highlighted == 0


# -- the audit trail --------------------------------------------------------------------------


@pytest.mark.slow
async def test_the_audit_trail_of_two_clients(two):
    alpha, _ = two
    for argv in (
        ("set", "max-num-seqs", "8"),
        ("prefix-cache", "off"),
        ("set", "max-num-seqs", "0"),
    ):
        alpha.ctl(*argv)
    chooser = SelectingResolver(str(alpha.runtime_dir), Selector(port=alpha.port))
    app = PagectlTop(ZmqSource(chooser), chooser=chooser)
    async with app.run_test(size=(200, 60)) as pilot:
        assert await wait_until(pilot, lambda: app.link.state == LIVE and app.control_ready, 20)
        await pilot.press("space")  # pause
        assert await wait_until(pilot, lambda: app.admission_paused, 10)
        await pilot.press("space")  # resume
        assert await wait_until(pilot, lambda: app.event_log.kind_counts["resume"] >= 1, 10)
        shown = "\n".join(app.event_log.lines_text())
    log = alpha.ctl("log")
    assert log.returncode == 0, log.stderr
    lines = log.stdout.splitlines()
    assert len(lines) == 5, lines
    assert "ctl@" in lines[0] and "set max_num_seqs: 256 -> 8  ok" in lines[0]
    assert "prefix_cache enable_prefix_caching: on -> off  ok" in lines[1]
    assert "REFUSED invalid_value" in lines[2]  # refused commands are recorded too
    me = f"uid={os.getuid()} pid={os.getpid()} (peer)"  # the console: this process
    assert "top@" in lines[3] and me in lines[3] and lines[3].split("  ")[2] == "pause"
    assert "top@" in lines[4] and me in lines[4] and "resume" in lines[4]
    assert all("(peer)" in ln for ln in lines)  # ipc: the kernel's credentials, not claims
    records = [json.loads(x) for x in alpha.ctl("log", "--json").stdout.splitlines()]
    assert records[0]["old"] == 256 and records[0]["new"] == 8
    assert records[0]["credentials"] == "peer" and records[0]["outcome"] == "ok"
    # The console showed the accepted ones in full: who, uid and pid.
    assert "max_num_seqs: 256 -> 8 by ctl@" in shown and "peer)" in shown
    assert "admission paused by top@" in shown and f"pid {os.getpid()}, peer" in shown
    for argv in (("set", "max-num-seqs", "256"), ("prefix-cache", "on")):
        alpha.ctl(*argv)


# -- scripting ----------------------------------------------------------------------------


@pytest.mark.slow
def test_top_once_json_and_ctl_watch(two):
    alpha, beta = two
    rt = str(alpha.runtime_dir)
    r = alpha.pagectl("top", "--runtime-dir", rt, "--port", str(beta.port), "--once", "--json")
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    assert snap["model"]["model"] == "beta" and snap["daemon"]["http_url"] == beta.base_url
    assert snap["blocks"]["num_blocks"] == 64 and "counters" in snap
    r = alpha.pagectl("top", "--runtime-dir", rt, "--once")  # two daemons: never a guess
    assert r.returncode == 2 and "2 daemons" in r.stderr
    r = alpha.pagectl("top", "--runtime-dir", rt, "--pid", str(alpha.proc.pid), "--once")
    assert r.returncode == 0 and "alpha" in r.stdout and "KV blocks" in r.stdout
    r = alpha.ctl("watch", "--count", "2", "--interval", "0.3")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["time", "running", "waiting", "kv%", "tok/s", "hit%", "preempt"]
    assert len(lines) == 3 and lines[2].split()[1:4] == ["0", "0", "0%"]


@pytest.mark.slow
def test_a_closed_pipe_is_not_a_traceback(two):
    alpha, _ = two
    argv = [sys.executable, "-m", "pagectl", "ctl", "--runtime-dir", str(alpha.runtime_dir)]
    argv += ["--port", str(alpha.port), "watch", "--count", "20", "--interval", "0.1"]
    cmd = " ".join(map(shlex.quote, argv)) + " | head -n 1"
    r = subprocess.run(
        ["bash", "-c", "set -o pipefail; " + cmd], capture_output=True, text=True, env=alpha.env
    )
    assert r.stdout.startswith("time") and "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 141


# -- text in the inspector ------------------------------------------------------------------


@pytest.mark.slow
async def test_the_inspector_shows_a_block_as_text_with_ids_a_key_away(two):
    import urllib.request

    from pagectl.tui.detokenize import Detokenizer
    from pagectl.tui.widgets.block_map import BlockMapView

    alpha, _ = two
    prompt = "The operator reads every cached block as text, not as a row of token ids. " * 2
    body = json.dumps({"model": "alpha", "prompt": prompt, "max_tokens": 2}).encode()
    req = urllib.request.Request(
        alpha.base_url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
    chooser = SelectingResolver(str(alpha.runtime_dir), Selector(port=alpha.port))
    detok = Detokenizer(lambda: chooser.info.tokenizer_path if chooser.info else None)
    app = PagectlTop(ZmqSource(chooser), chooser=chooser, detokenizer=detok)
    async with app.run_test(size=(160, 48)) as pilot:
        assert await wait_until(pilot, lambda: app.link.state == LIVE and app.control_ready, 20)
        cached = app.snapshot.blocks.hashed.index(1)  # a full block the prompt left cached
        app.query_one(BlockMapView).select_cell(cached)
        assert await wait_until(
            pilot, lambda: app.inspection is not None and app.inspection.status == "ok", 20
        )
        text = app.inspection.result["text"]
        assert len(text) >= 8 and text in prompt  # the block's 16 tokens, decoded
        shown = str(app.detail.render())
        assert "text   " in shown and text[:20] in shown and "i: ids" in shown
        await pilot.press("i")
        shown = str(app.detail.render())
        ids = app.inspection.result["token_ids"]
        assert f"tokens [{ids[0]}, {ids[1]}" in shown and "i: text" in shown
    r = alpha.ctl("inspect-block", str(cached))  # ctl decodes on its side too
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["text"] == text


@pytest.mark.slow
async def test_top_over_two_urls_and_over_a_router(two, aiohttp_server):
    """``top --url A --url B``: a fleet row each, n switches the panels to the other daemon;
    ``top --url ROUTER``: the router's local backends, a remote one listed as such."""
    import asyncio

    from pagectl.cli import build_parser
    from pagectl.cli.top import build_source
    from pagectl.control.fleet import host_port, plan_fleet
    from pagectl.router.backends import Backend, BackendSpec
    from pagectl.router.proxy import Router, create_router_app
    from pagectl.routing.policy import RoutingPolicy
    from pagectl.tui.fleet_source import FleetSource

    alpha, beta = two
    rt = str(alpha.runtime_dir)
    argv = ["top", "--runtime-dir", rt, "--url", alpha.base_url, "--url", beta.base_url]
    source, chooser = build_source(build_parser(argv).parse_args(argv))
    assert isinstance(source, FleetSource) and chooser is None
    app = PagectlTop(source)
    async with app.run_test(size=(160, 48)) as pilot:
        live = lambda: all(r.link == LIVE and r.stats for r in source.rows())  # noqa: E731
        assert await wait_until(pilot, live, 20), source.rows()
        assert [r.label for r in source.rows()] == [host_port(d.base_url) for d in two]
        assert await wait_until(pilot, lambda: app.snapshot is not None, 10)
        assert app.snapshot.model.model == "alpha"
        await pilot.press("n")
        assert await wait_until(
            pilot, lambda: app.snapshot is not None and app.snapshot.model.model == "beta", 10
        )
        header = app.query_one(ConsoleHeader).render()
        assert f"[2/2] {host_port(beta.base_url)}" in str(getattr(header, "plain", header))

    remote = "http://192.0.2.1:8000"  # TEST-NET: another host
    backends = [Backend(BackendSpec(d.base_url)) for d in two] + [Backend(BackendSpec(remote))]
    router = Router(backends, RoutingPolicy("load"), connect_timeout=0.2, health_timeout=0.5)
    server = await aiohttp_server(create_router_app(router))
    url = f"http://127.0.0.1:{server.port}"
    members = await asyncio.to_thread(plan_fleet, rt, Selector(url=url), [url])
    assert members is not None
    assert [(m.label, m.http_url, bool(m.unreachable)) for m in members] == [
        (host_port(alpha.base_url), alpha.base_url, False),
        (host_port(beta.base_url), beta.base_url, False),
        ("192.0.2.1:8000", remote, True),
    ]
    assert "another host" in members[2].unreachable
