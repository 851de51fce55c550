"""End to end: the daemon's life cycle on a tiny Qwen3 checkpoint. Admission control, SIGTERM
drain, a killed engine process, a killed daemon; and no process left behind in any case."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import openai
import psutil
import pytest
import requests

from pagectl.testing.daemon_process import DaemonProcess

pytestmark = pytest.mark.slow

NO_EOS = {"ignore_eos": True}


def start(tmp_path_factory, model, *extra, env=None) -> DaemonProcess:
    d = DaemonProcess(
        tmp_path_factory.mktemp("rt"),
        [
            "--model",
            str(model),
            "--served-model-name",
            "tiny",
            "--num-kv-blocks",
            "128",
            *extra,
        ],
        env=env,
    )
    return d.start()


def wait_exit(proc, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"process {proc.pid} still running after {timeout}s") from e


def assert_gone(procs: list[psutil.Process], timeout: float = 5.0) -> None:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, f"left behind: {alive}"


def stream_lines(url: str, body: dict, headers: dict | None = None):
    r = requests.post(
        url + "/v1/completions",
        json={**body, "stream": True},
        stream=True,
        timeout=60,
        headers=headers,
    )
    r.raise_for_status()
    return r, r.iter_lines()


@pytest.fixture(scope="module")
def drain_daemon(tmp_path_factory, tiny_qwen3):
    d = start(
        tmp_path_factory, tiny_qwen3, "--max-num-queued-requests", "2", "--drain-timeout", "8"
    )
    yield d
    d.kill()


def test_admission_control_503_with_retry_after(drain_daemon):
    d = drain_daemon
    assert d.ctl("pause").returncode == 0
    client = openai.OpenAI(base_url=d.base_url + "/v1", api_key="x", max_retries=0)
    results = []

    def call(i):
        r = client.completions.create(
            model="tiny", prompt=f"queued {i}", max_tokens=3, extra_body=NO_EOS
        )
        results.append(r.choices[0].finish_reason)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(100):
            st = json.loads(d.ctl("status", "--json").stdout)
            if st["num_waiting"] == 2:
                break
            time.sleep(0.05)
        assert st["num_waiting"] == 2
        r = requests.post(d.base_url + "/v1/completions", json={"prompt": "one more"}, timeout=10)
        assert r.status_code == 503
        assert r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
    finally:
        assert d.ctl("resume").returncode == 0
    for t in threads:
        t.join(30)
    assert results == ["length", "length"]


def test_sigterm_drains_then_exits_zero_leaving_nothing(drain_daemon):
    d = drain_daemon
    children = d.children()
    assert children, "the engine process should be a child of the daemon"
    runtime_files = list(d.runtime_dir.glob("*/runtime.json"))
    assert len(runtime_files) == 1
    # One request running (long), one queued behind a paused admission: the drain lets the
    # first finish and aborts the second at the drain timeout.
    resp, lines = stream_lines(
        d.base_url, {"prompt": "running", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    )
    first = next(ln for ln in lines if ln.startswith(b"data: {"))
    assert d.ctl("pause").returncode == 0
    queued = {}
    t = threading.Thread(
        target=lambda: queued.update(
            r=requests.post(
                d.base_url + "/v1/completions",
                json={"prompt": "queued", "max_tokens": 5, "ignore_eos": True},
                timeout=60,
            )
        )
    )
    t.start()
    for _ in range(100):
        if json.loads(d.ctl("status", "--json").stdout)["num_waiting"] == 1:
            break
        time.sleep(0.05)
    os.kill(d.proc.pid, signal.SIGTERM)
    time.sleep(0.3)
    # Draining: new work and health checks get 503.
    r = requests.post(d.base_url + "/v1/completions", json={"prompt": "late"}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert requests.get(d.base_url + "/health", timeout=10).status_code == 503
    # The running stream completes with all its tokens.
    chunks = [first] + [ln for ln in lines if ln.startswith(b"data: {")]
    assert len(chunks) == 100
    assert json.loads(chunks[-1][6:])["choices"][0]["finish_reason"] == "length"
    t.join(30)
    assert queued["r"].status_code == 200
    assert queued["r"].json()["choices"][0]["finish_reason"] == "abort"
    assert wait_exit(d.proc, 20) == 0
    assert_gone(children)
    assert not runtime_files[0].exists()
    assert not runtime_files[0].parent.exists()


def test_killed_engine_fails_requests_and_the_daemon_exits_nonzero(tmp_path_factory, tiny_qwen3):
    d = start(tmp_path_factory, tiny_qwen3, env={"PAGECTL_API_KEY": "k"})
    try:
        auth = {"Authorization": "Bearer k"}
        assert requests.get(d.base_url + "/v1/models", timeout=10).status_code == 401
        assert requests.get(d.base_url + "/v1/models", headers=auth, timeout=10).status_code == 200
        (engine,) = d.children()
        resp, lines = stream_lines(
            d.base_url, {"prompt": "doomed", "max_tokens": 400, "ignore_eos": True}, headers=auth
        )
        next(ln for ln in lines if ln.startswith(b"data: {"))
        engine.kill()
        rest = [ln for ln in lines if ln]
        errors = [json.loads(ln[6:]) for ln in rest if ln.startswith(b'data: {"error"')]
        assert errors and "engine" in errors[0]["error"]["message"]
        assert rest[-1] == b"data: [DONE]"
        assert requests.get(d.base_url + "/health", timeout=5).status_code == 503
        r = requests.post(
            d.base_url + "/v1/completions", json={"prompt": "x"}, headers=auth, timeout=5
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert wait_exit(d.proc, 10) == 1
        assert not list(d.runtime_dir.glob("*/runtime.json"))
    finally:
        d.kill()


def test_a_killed_daemon_takes_its_engine_down(tmp_path_factory, tiny_qwen3):
    d = start(tmp_path_factory, tiny_qwen3)
    try:
        (engine,) = d.children()
        d.proc.kill()
        d.proc.wait(10)
        assert_gone([engine], timeout=10)
    finally:
        d.kill()
