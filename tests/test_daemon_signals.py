"""/health under a frozen engine, and a second SIGTERM that ends streams properly.

Found by an adversarial run: /health stayed 200 while the engine process was SIGSTOPped,
and a second SIGTERM cut streams off with neither an error event nor ``[DONE]``.
"""

from __future__ import annotations

import json
import signal
import time

import requests
from test_engine_frames import fake_daemon


def _health(d) -> tuple[int, dict | None]:
    r = requests.get(d.base_url + "/health", timeout=5)
    return r.status_code, (r.json() if r.content else None)


def test_health_is_503_with_the_reason_while_the_engine_is_stopped(tmp_path_factory):
    d = fake_daemon(tmp_path_factory, "--health-stall-timeout", "1")
    d.start()
    (engine,) = [p for p in d.children() if "engine_process" in " ".join(p.cmdline())]
    try:
        assert _health(d)[0] == 200
        engine.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        status, body = _health(d)
        while status == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
            status, body = _health(d)
        assert status == 503, "health stayed 200 with the engine stopped"
        assert body["error"]["code"] == "engine_stalled"
        assert "has not answered" in body["error"]["message"]
        engine.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while _health(d)[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _health(d)[0] == 200
    finally:
        engine.send_signal(signal.SIGCONT)
        d.kill()


def test_a_second_sigterm_ends_streams_with_an_error_event_and_done(tmp_path_factory):
    d = fake_daemon(tmp_path_factory, env={"PAGECTL_FAKE_STEP_DELAY_S": "0.05"})
    d.start()
    try:
        r = requests.post(
            d.base_url + "/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True},
            stream=True,
            timeout=30,
        )
        assert r.status_code == 200
        lines = r.iter_lines()
        events = []
        for line in lines:
            if line:
                events.append(line)
            if len(events) >= 3:
                break
        d.proc.send_signal(signal.SIGTERM)  # drain: the stream would run to its end...
        time.sleep(0.3)
        d.proc.send_signal(signal.SIGTERM)  # ...but the second signal stops now
        rest = [line for line in lines if line]
        assert rest[-1] == b"data: [DONE]"
        err = json.loads(rest[-2][len(b"data: ") :])
        assert err["error"]["code"] == "shutting_down"
        tokens = sum(1 for e in events + rest[:-2] if b'"text"' in e)
        assert tokens < 200  # cut short, not drained
        assert d.proc.wait(20) == 0
    finally:
        d.kill()
