"""Telemetry over an endpoint other local users can reach asks for the control token.

Loopback TCP and abstract ``ipc://@`` telemetry was readable by every local user; now the
engine's PUB is a ZMQ PLAIN server whose password is the control token, and a subscriber
without it (or with a wrong one) receives nothing. ``--telemetry-public`` opts out.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import zmq
from test_engine_frames import fake_daemon

from pagectl.control.client import TelemetrySubscriber, find_runtime
from pagectl.control.telemetry_auth import (
    PLAIN,
    TelemetryAuth,
    present_token,
    server_mode,
    subscriber_token,
)
from pagectl.testing.daemon_process import free_port


def _sub(ctx: zmq.Context, endpoint: str, password: str | None) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    if password is not None:
        present_token(s, password)
    s.connect(endpoint)
    return s


def _received(sock: zmq.Socket, seconds: float) -> int:
    n = 0
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000)):
            sock.recv()
            n += 1
    return n


def test_a_subscriber_without_the_token_receives_nothing():
    ctx = zmq.Context()
    auth = TelemetryAuth(ctx, "tok-1")
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    auth.protect(pub)
    pub.bind("tcp://127.0.0.1:0")
    ep = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
    subs = {
        "none": _sub(ctx, ep, None),
        "wrong": _sub(ctx, ep, "tok-2"),
        "right": _sub(ctx, ep, "tok-1"),
    }
    stop = threading.Event()

    def publish() -> None:
        while not stop.is_set():
            pub.send(b"snapshot")
            time.sleep(0.02)

    t = threading.Thread(target=publish)
    t.start()
    try:
        got = {k: _received(s, 1.5) for k, s in subs.items()}
    finally:
        stop.set()
        t.join()
        for s in subs.values():
            s.close(linger=0)
        pub.close(linger=0)
        auth.stop()
        ctx.term()
    assert got["none"] == 0 and got["wrong"] == 0
    assert got["right"] > 10


def test_which_endpoints_ask_for_the_token(tmp_path):
    assert server_mode("tcp://127.0.0.1:5555", public=False) == PLAIN
    assert server_mode("ipc://@pagectl-x", public=False) == PLAIN
    assert server_mode("ipc:///run/user/0/pagectl/1/telemetry", public=False) == ""
    assert server_mode("tcp://127.0.0.1:5555", public=True) == ""
    tok = tmp_path / "token"
    tok.write_text("t-9\n")
    # From a runtime file its telemetry_auth decides; by hand, the endpoint's kind.
    assert subscriber_token("ipc:///x", str(tok), PLAIN) == "t-9"
    assert subscriber_token("tcp://127.0.0.1:1", str(tok), "") is None
    assert subscriber_token("tcp://127.0.0.1:1", str(tok), None) == "t-9"
    assert subscriber_token("ipc:///x", str(tok), None) is None
    assert subscriber_token("tcp://127.0.0.1:1", None, PLAIN) is None


@pytest.fixture(scope="module")
def tcp_daemon(tmp_path_factory):
    port = free_port()
    d = fake_daemon(
        tmp_path_factory, "--admin-telemetry-endpoint", f"tcp://127.0.0.1:{port}"
    ).start()
    yield d, f"tcp://127.0.0.1:{port}"
    d.kill()


def test_daemon_telemetry_over_tcp_needs_the_token(tcp_daemon):
    d, ep = tcp_daemon
    info = find_runtime(d.runtime_dir)
    assert info.telemetry_endpoint == ep and info.telemetry_auth == PLAIN
    ctx = zmq.Context()
    bare = _sub(ctx, ep, None)
    try:
        with TelemetrySubscriber.for_runtime(info) as sub:
            assert sub.recv(timeout=10) is not None
        assert _received(bare, 1.0) == 0  # same second, same publisher: nothing without it
    finally:
        bare.close(linger=0)
        ctx.term()
    out = d.pagectl("top", "--once", "--json", "--runtime-dir", str(d.runtime_dir))
    assert out.returncode == 0, out.stderr
    assert "num_running" in json.loads(out.stdout)
    by_hand = d.pagectl(
        "top", "--once", "--json", "--telemetry", ep, "--token-file", info.token_file
    )
    assert by_hand.returncode == 0, by_hand.stderr


def test_telemetry_public_asks_nothing(tmp_path_factory):
    port = free_port()
    ep = f"tcp://127.0.0.1:{port}"
    d = fake_daemon(
        tmp_path_factory, "--admin-telemetry-endpoint", ep, "--telemetry-public"
    ).start()
    ctx = zmq.Context()
    bare = _sub(ctx, ep, None)
    try:
        assert find_runtime(d.runtime_dir).telemetry_auth == ""
        assert _received(bare, 1.5) > 0
    finally:
        bare.close(linger=0)
        ctx.term()
        d.kill()
