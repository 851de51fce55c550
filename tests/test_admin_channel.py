"""End to end: the admin channel of a real daemon (tiny Qwen3), through ``pagectl ctl`` and
the reusable client classes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time

import openai
import pytest

from pagectl.control.client import AdminClient, AdminError, TelemetrySubscriber, find_runtime
from pagectl.engine.commands import GetStatus

pytestmark = pytest.mark.slow

NO_EOS = {"ignore_eos": True}
# 48 tokens or more with the tiny tokenizer: at least two full blocks of 16.
LONG_PROMPT = "A request is admitted when the scheduler finds free blocks for its prompt. " * 3


@pytest.fixture(scope="module")
def daemon(tiny_daemon):
    return tiny_daemon(
        [
            "--num-kv-blocks",
            "128",
            "--max-num-batched-tokens",
            "256",
            "--max-num-seqs",
            "32",
        ]
    )


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base_url + "/v1", api_key="unused", max_retries=0)


def ctl_ok(daemon, *argv) -> str:
    r = daemon.ctl(*argv)
    assert r.returncode == 0, (argv, r.stdout, r.stderr)
    return r.stdout


def status(daemon) -> dict:
    return json.loads(ctl_ok(daemon, "status", "--json"))


def cached_tokens(client, prompt: str) -> int:
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, temperature=0, extra_body=NO_EOS
    )
    return r.usage.prompt_tokens_details.cached_tokens


def test_runtime_file_token_and_status(daemon):
    info = find_runtime(daemon.runtime_dir)
    assert info.pid == daemon.proc.pid and info.model == "tiny"
    assert info.http_url == daemon.base_url
    assert info.telemetry_endpoint.startswith("ipc://")
    assert info.control_endpoint.startswith("ipc://")
    assert stat.S_IMODE(os.stat(info.token_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(info.token_file)).st_mode) == 0o700
    st = status(daemon)
    cfg = st["config"]
    assert cfg["max_num_batched_tokens"] == 256
    assert cfg["max_num_seqs"] == 32
    assert cfg["enable_prefix_caching"] is True
    assert st["engine_state"] == "running" and st["kv"]["num_blocks"] == 128
    text = ctl_ok(daemon, "status")
    assert "max_num_batched_tokens=256" in text and "enable_prefix_caching=on" in text
    assert st["attention_backend"] in ("cpu-kernel", "torch") and st["memory_profile"] == {}
    assert (
        f"execution attention {st['attention_backend']}, KV cache {st['kv_cache_dtype']}, "
        "CUDA graphs off" in text
    )


def test_prefix_cache_off_reports_zero_cached_tokens(daemon, client):
    cached_tokens(client, LONG_PROMPT)
    assert cached_tokens(client, LONG_PROMPT) >= 32
    assert "enable_prefix_caching: on -> off" in ctl_ok(daemon, "prefix-cache", "off")
    assert status(daemon)["config"]["enable_prefix_caching"] is False
    assert cached_tokens(client, LONG_PROMPT) == 0
    assert cached_tokens(client, LONG_PROMPT) == 0
    ctl_ok(daemon, "prefix-cache", "on")
    assert status(daemon)["config"]["enable_prefix_caching"] is True
    cached_tokens(client, LONG_PROMPT)
    assert cached_tokens(client, LONG_PROMPT) >= 32
    out = ctl_ok(daemon, "reset-prefix-cache")
    assert "cached blocks released" in out
    assert cached_tokens(client, LONG_PROMPT) == 0


def test_token_budget_change_shows_in_status_and_in_scheduled_steps(daemon, client):
    assert "max_num_batched_tokens: 256 -> 8" in ctl_ok(
        daemon, "set", "max-num-batched-tokens", "8"
    )
    try:
        assert status(daemon)["config"]["max_num_batched_tokens"] == 8
        with TelemetrySubscriber(
            find_runtime(daemon.runtime_dir).telemetry_endpoint, conflate=False
        ) as sub:
            ctl_ok(daemon, "prefix-cache", "off")  # all 50+ prompt tokens are computed
            r = client.completions.create(
                model="tiny", prompt=LONG_PROMPT + "x", max_tokens=1, extra_body=NO_EOS
            )
            assert r.usage.prompt_tokens > 40
            steps = {}
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and len(steps) < r.usage.prompt_tokens // 8:
                snap = sub.recv(timeout=1)
                for s in snap.steps if snap else []:
                    if s.token_budget == 8:
                        steps[s.step_id] = s
        scheduled = [s.num_scheduled_tokens for s in steps.values()]
        assert len(scheduled) >= r.usage.prompt_tokens // 8
        assert max(scheduled) == 8  # the prompt is chunked by the new budget
        last = status(daemon)["last_steps"]
        assert all(s["token_budget"] == 8 and s["num_scheduled_tokens"] <= 8 for s in last)
    finally:
        ctl_ok(daemon, "set", "max-num-batched-tokens", "256")
        ctl_ok(daemon, "prefix-cache", "on")
    assert status(daemon)["config"]["max_num_batched_tokens"] == 256


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["set", "max-num-seqs", "0"], "max_num_seqs must be in [1, 32]"),
        (["set", "max-num-seqs", "1000"], "max_num_seqs must be in [1, 32]"),
        (["set", "max-num-batched-tokens", "lots"], "must be an integer"),
        (["set", "warp-factor", "9"], "unknown setting 'warp_factor'"),
        (["set", "enable-prefix-caching", "maybe"], "on/off"),
        (["abort", "no-such-request"], "no live request"),
        (["inspect-block", "100000"], "does not exist"),
    ],
)
def test_invalid_commands_are_refused_with_a_clear_message(daemon, argv, words):
    before = status(daemon)["config"]
    r = daemon.ctl(*argv)
    assert r.returncode == 1
    assert words in r.stderr and r.stderr.startswith("pagectl ctl: refused (")
    assert status(daemon)["config"] == before


def test_pause_abort_resume(daemon, client):
    ctl_ok(daemon, "pause")
    result = {}

    def call():
        result["r"] = client.completions.create(
            model="tiny", prompt="paused", max_tokens=4, extra_body=NO_EOS
        )

    t = threading.Thread(target=call)
    t.start()
    try:
        for _ in range(100):
            st = status(daemon)
            if st["requests"]:
                break
            time.sleep(0.05)
        assert st["config"]["paused"] is True and st["num_waiting"] == 1
        (req,) = st["requests"]
        assert req["state"] == "waiting"
        assert f"aborted {req['request_id']}" in ctl_ok(daemon, "abort", req["request_id"])
        t.join(10)
        assert result["r"].choices[0].finish_reason == "abort"
    finally:
        ctl_ok(daemon, "resume")
    r = client.completions.create(model="tiny", prompt="resumed", max_tokens=3, extra_body=NO_EOS)
    assert r.choices[0].finish_reason == "length"


def test_telemetry_snapshots_are_versioned_and_sequenced(daemon):
    info = find_runtime(daemon.runtime_dir)
    with TelemetrySubscriber(info.telemetry_endpoint, conflate=False) as sub:
        snaps = [sub.recv(timeout=2) for _ in range(5)]
    assert all(s is not None and s.version == 1 for s in snaps)
    seqs = [s.seq for s in snaps]
    assert seqs == sorted(seqs) and len(set(seqs)) == 5
    s = snaps[-1]
    assert s.model.model == "tiny" and s.blocks.num_blocks == 128
    assert len(s.blocks.ref_counts) == 128
    # Config changes are audited with the client's name.
    assert any(
        e.kind == "config" and str(e.data.get("client", "")).startswith("ctl@") for e in s.events
    )


def test_a_wrong_token_is_refused(daemon):
    info = find_runtime(daemon.runtime_dir)
    with AdminClient(info.control_endpoint, "not-the-token") as c, pytest.raises(AdminError) as ei:
        c.command(GetStatus())
    assert ei.value.kind == "unauthorized"
    with AdminClient.from_runtime(info) as c:
        assert c.command(GetStatus())["model"] == "tiny"


def test_ctl_without_a_daemon_says_so(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "pagectl", "ctl", "--runtime-dir", str(tmp_path), "status"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 3
    assert "no running pagectl daemon" in r.stderr
