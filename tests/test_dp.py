"""``pagectl daemon --data-parallel-size 2``: two engine processes behind one API server.

One DP=2 daemon on the tiny Qwen3 model serves the SDK, greedy equality, prefix affinity,
spread, ``ctl --engine`` and the ``engine`` label; two DP=2 daemons on the fake model (slow
steps) take the destructive cases: one engine killed, and SIGTERM. All three start at once.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import signal
import time
import urllib.request

import openai
import pytest

from pagectl.testing.daemon_process import DaemonProcess

pytestmark = pytest.mark.slow

NO_EOS = {"ignore_eos": True}
SYSTEM = "".join(f"You are assistant number {i} of the fleet; be precise. " for i in range(4))


@pytest.fixture(scope="module")
def daemons(tmp_path_factory, tiny_qwen3, tok_dir):
    real = DaemonProcess(
        tmp_path_factory.mktemp("rt"),
        [
            "--model", str(tiny_qwen3), "--served-model-name", "tiny", "--device", "cpu",
            "--num-kv-blocks", "256", "--dtype", "float32", "-dp", "2", "--dp-cpu-threads", "1",
        ],
    )  # fmt: skip
    fake = [
        DaemonProcess(
            tmp_path_factory.mktemp("rt"),
            [
                "--model",
                str(tok_dir),
                "--engine-factory",
                "pagectl.testing.fake_engine:fake_engine",
                "--num-kv-blocks",
                "256",
                "--data-parallel-size",
                "2",
                "--dp-routing",
                "round_robin",
            ],
            env={"PAGECTL_FAKE_STEP_DELAY_S": "0.05"},
        )  # fmt: skip
        for _ in range(2)
    ]
    ds = [real, *fake]
    try:
        for d in ds:
            d.launch()
        for d in ds:
            d.wait_ready(400)  # three daemons start at once on a shared machine
        yield {"real": real, "kill": fake[0], "term": fake[1]}
    finally:
        for d in ds:
            d.kill()


@pytest.fixture(scope="module")
def client(daemons):
    url = daemons["real"].base_url + "/v1"
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def _metrics(d: DaemonProcess) -> str:
    with urllib.request.urlopen(d.base_url + "/metrics", timeout=10) as r:
        return r.read().decode()


def _by_engine(text: str, name: str, **labels: str) -> dict[str, float]:
    """engine label -> value of series ``name`` (its other labels as given)."""
    out: dict[str, float] = {}
    for lab, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        kv = dict(re.findall(r'(\w+)="([^"]*)"', lab))
        if all(kv.get(k) == v for k, v in labels.items()):
            out[kv["engine"]] = out.get(kv["engine"], 0.0) + float(value)
    return out


def _decisions(d: DaemonProcess) -> dict[str, float]:
    return _by_engine(_metrics(d), "pagectl:dp_routing_decisions_total")


def test_sdk_greedy_outputs_equal_a_single_engine(daemons, client, tiny_qwen3):
    from pagectl.engine.llm import LLM
    from pagectl.engine.sampling_params import SamplingParams

    prompts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(6)]
    before = _by_engine(_metrics(daemons["real"]), "pagectl:generation_tokens_total")

    def one(p: str) -> str:
        r = client.completions.create(
            model="tiny", prompt=p, max_tokens=10, temperature=0, extra_body=NO_EOS
        )
        return r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        served = list(pool.map(one, prompts))
    after = _by_engine(_metrics(daemons["real"]), "pagectl:generation_tokens_total")
    assert all(after[e] > before.get(e, 0) for e in ("0", "1")), (before, after)
    llm = LLM(model=str(tiny_qwen3), dtype="float32", num_kv_blocks=256, device="cpu")
    try:
        ref = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    finally:
        llm.shutdown()
    assert served == [o.outputs[0].text for o in ref]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.usage.completion_tokens == 3


def test_shared_prefix_lands_its_hits_on_one_engine(daemons, client):
    d = daemons["real"]
    before = _decisions(d)
    cached = []
    for i in range(16):
        applied = sum(_by_engine(_metrics(d), "pagectl:dp_kv_event_batches_total").values())
        r = client.completions.create(
            model="tiny", prompt=SYSTEM + f"Question {i}?", max_tokens=2, temperature=0
        )
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        if i == 0:  # the first prefill's KV events reach the dispatcher (a loaded machine
            # can delay them past the next request, which would then go by load)
            deadline = time.monotonic() + 10
            while (
                sum(_by_engine(_metrics(d), "pagectl:dp_kv_event_batches_total").values())
                <= applied
            ):
                assert time.monotonic() < deadline, "no KV-event batch reached the dispatcher"
                time.sleep(0.05)
        time.sleep(0.05)
    assert sum(c > 0 for c in cached) >= 14, cached
    after = _decisions(daemons["real"])
    sent = sorted(after[e] - before.get(e, 0) for e in after)
    assert sent[-1] >= 15, sent


def test_unrelated_requests_spread(daemons, client):
    before = _decisions(daemons["real"])
    rng = random.Random(7)
    prompts = [
        f"{i} " + " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(6))
        for i in range(64)
    ]

    def one(p: str) -> None:
        client.completions.create(model="tiny", prompt=p, max_tokens=2)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, prompts))
    after = _decisions(daemons["real"])
    sent = {e: after[e] - before.get(e, 0) for e in after}
    assert sum(sent.values()) == 64
    assert max(sent.values()) <= 0.6 * 64, sent


def test_ctl_engine_status_and_the_engine_label(daemons):
    d = daemons["real"]
    r = d.ctl("--engine", "1", "status", "--json")
    assert r.returncode == 0, r.stderr
    one = json.loads(r.stdout)
    r = d.ctl("status", "--json")
    assert r.returncode == 0, r.stderr
    both = json.loads(r.stdout)["engines"]
    assert [e["engine"] for e in both] == [0, 1]
    assert both[1]["kv"]["num_blocks"] == one["kv"]["num_blocks"] == 256
    time.sleep(0.3)  # the engines' stats for /metrics are at most 100 ms old
    hits = _by_engine(_metrics(d), "pagectl:prefix_cache_hits_total")
    assert hits["1"] == one["counters"]["prefix_hits"]
    assert set(_by_engine(_metrics(d), "pagectl:num_requests_running")) == {"0", "1"}
    text = d.ctl("status", "--window", "0").stdout
    assert "engine 0\n" in text and "engine 1\n" in text
    assert d.ctl("--engine", "2", "status").returncode == 2
    assert d.info is not None and [e.index for e in d.info.engines] == [0, 1]
    assert d.info.engines[0].control_endpoint == d.info.control_endpoint


def _streams(d: DaemonProcess, n: int, max_tokens: int = 200):
    """``n`` streaming completions opened in turn (round robin: engine i % 2), each read
    up to its first chunk: (connection, response) pairs."""
    import http.client

    out = []
    for _ in range(n):
        c = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
        body = {"prompt": "x", "max_tokens": max_tokens, "stream": True, **NO_EOS}
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200
        assert r.readline().startswith(b"data: ")
        out.append((c, r))
    return out


def _engine_pids(d: DaemonProcess) -> list[int]:
    import psutil

    assert d.proc is not None
    kids = psutil.Process(d.proc.pid).children()
    return [k.pid for k in sorted(kids, key=lambda k: (k.create_time(), k.pid))]


def _running(d: DaemonProcess, engine: int) -> tuple[int, int]:
    r = d.ctl("--engine", str(engine), "status", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    return s["num_running"] + s["num_waiting"], s["kv"]["num_used_blocks"]


def test_disconnects_abort_on_their_engine_then_one_engine_is_killed(daemons):
    import os

    d = daemons["kill"]
    gone = _streams(d, 2)  # engines 0, 1; 200 tokens take 10 s at 50 ms a step
    for conn, _ in gone:
        conn.close()  # the client leaves mid-stream
    deadline = time.monotonic() + 5
    while [_running(d, 0), _running(d, 1)] != [(0, 0), (0, 0)]:
        assert time.monotonic() < deadline, [_running(d, 0), _running(d, 1)]
        time.sleep(0.2)
    streams = _streams(d, 4)  # engines 0, 1, 0, 1
    os.kill(_engine_pids(d)[1], signal.SIGKILL)
    texts = [r.read().decode() for _, r in streams]
    assert ['"error"' in t for t in texts] == [False, True, False, True], texts
    assert all(t.rstrip().endswith("data: [DONE]") for t in texts)
    with urllib.request.urlopen(d.base_url + "/health", timeout=5) as r:
        health = json.loads(r.read())
    assert health["status"] == "degraded"
    assert [e["state"] for e in health["engines"]] == ["ok", "dead"]
    for _ in range(3):  # the survivor takes every new request
        req = urllib.request.Request(
            d.base_url + "/v1/completions",
            json.dumps({"prompt": "y", "max_tokens": 2}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 2
    assert d.proc is not None and d.proc.poll() is None
    alive = _by_engine(_metrics(d), "pagectl:dp_engine_alive")
    assert alive == {"0": 1.0, "1": 0.0}


def test_sigterm_drains_both_engines(daemons):
    d = daemons["term"]
    streams = _streams(d, 2, max_tokens=40)  # one on each engine
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    texts = [r.read().decode() for _, r in streams]
    for t in texts:
        assert '"error"' not in t and t.rstrip().endswith("data: [DONE]")
        assert re.search(r'"finish_reason": ?"length"', t), t[-300:]
    assert d.proc.wait(30) == 0
    assert not d.children()
