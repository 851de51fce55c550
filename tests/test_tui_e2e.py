"""End to end: the real console attached over ZMQ to a real daemon serving a tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from test_tui_app import SIZE, wait_answers, wait_until
from tiny_models import build_tiny_model

from pagectl.engine.commands import SetConfig, SetPrefixCaching
from pagectl.testing.daemon_process import DaemonProcess
from pagectl.tui.app import PagectlTop
from pagectl.tui.connection import LIVE
from pagectl.tui.zmq_source import ZmqSource, runtime_resolver

SHARED_PREFIX = list(range(10, 74))  # 64 tokens: 4 blocks every request shares


def post_json(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class MixedLoad:
    """Threads sending completions until stopped: a shared prefix, some n=3, long decodes."""

    def __init__(self, base_url: str, workers: int = 6, max_tokens: int = 96) -> None:
        self.base_url = base_url
        self.max_tokens = max_tokens
        self.stop_event = threading.Event()
        self.done = 0
        self.errors: list[str] = []
        with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as r:
            self.model = json.loads(r.read())["data"][0]["id"]
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)
        ]

    def start(self) -> MixedLoad:
        for t in self.threads:
            t.start()
        return self

    def _run(self, worker: int) -> None:
        k = 0
        while not self.stop_event.is_set():
            k += 1
            tail = [100 + (worker * 31 + k * 7 + j) % 250 for j in range(20 + 9 * (k % 5))]
            body = {
                "model": self.model,
                "prompt": SHARED_PREFIX + tail,
                "max_tokens": self.max_tokens,
                "temperature": 0.8,
                "seed": worker * 1000 + k,
                "ignore_eos": True,
                "n": 3 if worker % 3 == 0 else 1,
            }
            try:
                post_json(self.base_url + "/v1/completions", body)
                self.done += 1
            except Exception as e:  # the daemon going away ends the load
                self.errors.append(repr(e))
                if self.stop_event.wait(0.2):
                    return

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=30)


def start_daemon(tmp_path, num_kv_blocks: int = 48) -> DaemonProcess:
    model = build_tiny_model(tmp_path / "model", "qwen3")
    args = [
        "--model", str(model), "--device", "cpu", "--dtype", "float32",
        "--num-kv-blocks", str(num_kv_blocks), "--max-num-batched-tokens", "128",
        "--max-num-seqs", "16", "--max-model-len", "512",
    ]  # fmt: skip
    return DaemonProcess(tmp_path / "run", args).start()


async def wait_for(pilot, predicate, timeout: float = 30.0) -> None:
    assert await wait_until(pilot, predicate, timeout), "condition not reached in time"


async def status(daemon: DaemonProcess) -> dict:
    out = await asyncio.to_thread(daemon.ctl, "status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
async def test_keys_steer_a_real_daemon_under_load(tmp_path):
    daemon = start_daemon(tmp_path)
    load = MixedLoad(daemon.base_url).start()
    try:
        app = PagectlTop(ZmqSource(runtime_resolver(str(tmp_path / "run"))))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(
                pilot,
                lambda: (
                    app.link.state == LIVE
                    and app.snapshot is not None
                    and app.snapshot.num_running > 0
                ),
            )
            assert app.source.can_control
            before = await status(daemon)
            assert before["config"]["enable_prefix_caching"] is True
            budget = before["config"]["max_num_batched_tokens"]

            await pilot.press("p")
            await wait_answers(pilot, app, 1)
            assert app.answers[-1][:2] == (SetPrefixCaching(enabled=False), True)
            assert (await status(daemon))["config"]["enable_prefix_caching"] is False

            await pilot.press("right_square_bracket")
            await wait_answers(pilot, app, 2)
            assert app.answers[-1][:2] == (SetConfig("max_num_batched_tokens", 160), True)
            assert app.answers[-1][2] == f"max_num_batched_tokens: {budget} → 160"
            assert (await status(daemon))["config"]["max_num_batched_tokens"] == 160
            # The console's own picture follows the daemon's telemetry.
            await wait_for(
                pilot,
                lambda: (
                    app.snapshot.config["max_num_batched_tokens"] == 160
                    and not app.snapshot.config["enable_prefix_caching"]
                ),
            )
            # Both changes reached the event log (the snapshot itself carries only the most
            # recent events, which preemptions under this load soon push out).
            await wait_for(pilot, lambda: app.event_log.kind_counts["config"] >= 2)
    finally:
        load.stop()
        daemon.kill()
    assert load.done > 0


@pytest.mark.slow
async def test_the_console_survives_the_daemon_going_away(tmp_path):
    daemon = start_daemon(tmp_path)
    try:
        app = PagectlTop(ZmqSource(runtime_resolver(str(tmp_path / "run")), reconnect_after=0.5))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.link.state == LIVE)
            seq = app.snapshot.seq
            await asyncio.to_thread(daemon.kill)
            await wait_for(pilot, lambda: app.link.state == "stale", timeout=10)
            assert app.snapshot.seq >= seq  # the last picture is kept
            assert app.check_action("toggle_prefix_caching", ()) is None
            # A new daemon in the same runtime directory: the console attaches by itself.
            daemon = DaemonProcess(tmp_path / "run", daemon.args).start()
            await wait_for(pilot, lambda: app.link.state == LIVE, timeout=60)
            assert app.source.can_control
    finally:
        daemon.kill()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_top_in_a_real_80x24_terminal(tmp_path, tok_dir):
    """`pagectl top` in tmux at 80x24 against a (fake-model) daemon: the block map, KV usage,
    the events panel and the requests table are all on screen."""
    fake = ["--engine-factory", "pagectl.testing.fake_engine:fake_engine"]
    daemon = DaemonProcess(tmp_path / "run", ["--model", str(tok_dir), *fake]).start()
    session = f"pagectl-e2e-{os.getpid()}"
    cmd = (
        f"{shlex.quote(sys.executable)} -m pagectl top --runtime-dir "
        f"{shlex.quote(str(daemon.runtime_dir))}"
    )
    env = {k: v for k, v in daemon.env.items() if k in ("PYTHONPATH", "PATH", "HOME")}
    tmux = ["tmux", "-L", session]
    try:
        subprocess.run(
            [*tmux, "new-session", "-d", "-s", session, "-x", "80", "-y", "24",
             "env", *(f"{k}={v}" for k, v in env.items()), "TERM=xterm-256color", "sh", "-c",
             cmd],
            check=True,
        )  # fmt: skip
        screen = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            screen = subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True
            ).stdout
            if "● live" in screen and "KV usage" in screen and "Events" in screen:
                break
            time.sleep(0.5)
        lines = screen.splitlines()
        assert len(lines) <= 24 and max(map(len, lines)) <= 80
        for words in ("KV blocks ·", "KV usage", "Events", "Requests", "● live", daemon.base_url):
            assert words in screen, screen
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        daemon.kill()
