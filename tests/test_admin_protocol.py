"""Admin channel units: control request handling, the wire format as another client would
write it, the runtime directory, and the engine loop over real ZMQ sockets (inproc)."""

from __future__ import annotations

import os
import stat
import threading
import time

import msgspec
import pytest
import zmq

from pagectl.control.client import AdminClient, AdminError, TelemetrySubscriber
from pagectl.control.protocol import ControlRequest, RuntimeInfo, decode_reply, encode
from pagectl.control.runtime import (
    DaemonDir,
    RuntimeNotFound,
    find_runtime,
    loopback_only,
    read_token,
)
from pagectl.engine.args import EngineArgs
from pagectl.engine.commands import GetStatus, SetConfig, SetPrefixCaching
from pagectl.engine.outputs import EngineRequest
from pagectl.engine.telemetry import decode_snapshot
from pagectl.engine_process import wire
from pagectl.engine_process.control_handler import handle_control
from pagectl.engine_process.loop import EngineLoop
from pagectl.testing.fake_engine import fake_engine

TOKEN = "s3cret-token"


def make_core(**kw):
    args = EngineArgs(max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=32, **kw)
    return fake_engine(args).core


def raw_request(**fields) -> bytes:
    """A control request built as a plain msgpack map, the way a client in another language
    following docs/ADMIN_PROTOCOL.md would build it."""
    return msgspec.msgpack.encode(fields)


# -- control requests ---------------------------------------------------------------------


def test_control_set_applies_and_audits_the_client():
    core = make_core()
    frame = raw_request(
        id=7,
        token=TOKEN,
        client="ctl@test",
        command={"cmd": "set", "name": "max-num-batched-tokens", "value": 32},
        version=1,
    )
    reply, changed = handle_control(core, TOKEN, frame)
    r = decode_reply(reply)
    assert (r.id, r.ok, r.error) == (7, True, None)
    assert r.result == {"name": "max_num_batched_tokens", "old": 64, "new": 32}
    assert changed
    assert core.scheduler.config.max_num_batched_tokens == 32
    ev = list(core.scheduler.events)[-1]
    assert ev.kind == "config"
    assert ev.data == {
        "name": "max_num_batched_tokens",
        "old": 64,
        "new": 32,
        "client": "ctl@test",
    }


def test_control_wrong_token_is_refused_before_the_command_is_read():
    core = make_core()
    # The command is garbage: an unauthorized client must not learn that.
    frame = raw_request(id=3, token="wrong", command={"cmd": "no-such"})
    r = decode_reply(handle_control(core, TOKEN, frame)[0])
    assert (r.id, r.ok, r.error.kind) == (3, False, "unauthorized")
    frame = raw_request(id=4, token="", command={"cmd": "status"})
    assert decode_reply(handle_control(core, TOKEN, frame)[0]).error.kind == "unauthorized"


@pytest.mark.parametrize(
    ("command", "kind", "words"),
    [
        ({"cmd": "set", "name": "max_num_seqs", "value": 0}, "invalid_value", "max_num_seqs"),
        ({"cmd": "set", "name": "max_num_seqs", "value": "lots"}, "invalid_value", "integer"),
        ({"cmd": "set", "name": "warp_drive", "value": 1}, "unknown_setting", "warp_drive"),
        ({"cmd": "abort", "request_id": "nope"}, "not_found", "nope"),
        ({"cmd": "inspect_block", "block_id": 10_000}, "not_found", "10000"),
        ({"cmd": "self_destruct"}, "unknown_command", "self_destruct"),
        ({"cmd": "set", "name": "max_num_seqs"}, "bad_request", "value"),
    ],
)
def test_control_errors_are_typed(command, kind, words):
    core = make_core()
    before = core.scheduler.live_config()
    r = decode_reply(
        handle_control(core, TOKEN, raw_request(id=1, token=TOKEN, command=command))[0]
    )
    assert not r.ok
    assert r.error.kind == kind
    assert words in r.error.message
    assert core.scheduler.live_config() == before


def test_control_malformed_frames_get_bad_request():
    core = make_core()
    r = decode_reply(handle_control(core, TOKEN, b"\xc1 not msgpack")[0])
    assert (r.id, r.ok, r.error.kind) == (0, False, "bad_request")
    # Missing token: the id is still echoed so the client can match the reply.
    r = decode_reply(handle_control(core, TOKEN, raw_request(id=9, command={"cmd": "status"}))[0])
    assert (r.id, r.error.kind) == (9, "bad_request")
    frame = raw_request(id=5, token=TOKEN, command={"cmd": "status"}, version=2)
    r = decode_reply(handle_control(core, TOKEN, frame)[0])
    assert r.error.kind == "bad_request" and "version 2" in r.error.message


def test_control_request_struct_matches_the_documented_map():
    req = ControlRequest(id=1, token="t", client="c", command=SetPrefixCaching(False))
    assert msgspec.msgpack.decode(encode(req)) == {
        "id": 1,
        "token": "t",
        "client": "c",
        "command": {"cmd": "prefix_cache", "enabled": False},
        "version": 1,
        # The sender's own uid and pid, for the audit log (peer credentials win on ipc).
        "uid": os.getuid(),
        "pid": os.getpid(),
    }


def test_status_result_is_plain_msgpack_with_the_live_config():
    core = make_core()
    r = decode_reply(
        handle_control(core, TOKEN, encode(ControlRequest(id=2, token=TOKEN, command=GetStatus())))[
            0
        ]
    )
    cfg = r.result["config"]
    assert cfg["max_num_batched_tokens"] == 64
    assert cfg["max_num_seqs"] == 8
    assert cfg["enable_prefix_caching"] is True


# -- runtime directory --------------------------------------------------------------------


def test_daemon_dir_permissions_and_find_runtime(tmp_path):
    rt = tmp_path / "rt"
    d = DaemonDir(rt, pid=os.getpid())
    token = d.create_token()
    assert stat.S_IMODE(os.stat(rt).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(d.token_file).st_mode) == 0o600
    assert read_token(d.token_file) == token and len(token) >= 32
    with pytest.raises(RuntimeNotFound, match="no running pagectl daemon"):
        find_runtime(rt)

    def info(pid, start):
        return RuntimeInfo(
            pid=pid,
            start_time=start,
            model="m",
            http_url="http://127.0.0.1:1",
            telemetry_endpoint=d.endpoint("telemetry"),
            control_endpoint=d.endpoint("control"),
            token_file=str(d.token_file),
        )

    d.write_runtime(info(os.getpid(), 100.0))
    assert stat.S_IMODE(os.stat(d.runtime_file).st_mode) == 0o600
    # A newer runtime file whose daemon is dead is ignored.
    dead = DaemonDir(rt, pid=2**22 + 12345)
    dead.write_runtime(info(2**22 + 12345, 200.0))
    assert find_runtime(rt).pid == os.getpid()
    assert find_runtime(d.path).pid == os.getpid()
    assert find_runtime(d.runtime_file).start_time == 100.0
    assert d.endpoint("control") == f"ipc://{d.path}/control.sock"
    d.remove()
    assert not d.path.exists()


def test_long_runtime_paths_get_short_socket_dirs(tmp_path):
    d = DaemonDir(tmp_path / ("x" * 120), pid=1)
    ep = d.endpoint("telemetry")
    assert ep.startswith("ipc://") and len(ep) < 110
    sock_dir = os.path.dirname(ep[len("ipc://") :])
    assert stat.S_IMODE(os.stat(sock_dir).st_mode) == 0o700
    d.remove()
    assert not os.path.exists(sock_dir)


def test_admin_endpoints_must_be_loopback():
    for ok in (
        "ipc:///tmp/x.sock",
        "tcp://127.0.0.1:5555",
        "tcp://[::1]:5555",
        "tcp://localhost:1",
    ):
        loopback_only(ok)
    for bad in ("tcp://0.0.0.0:5555", "tcp://10.1.2.3:5555", "tcp://*:5555", "udp://x"):
        with pytest.raises(ValueError):
            loopback_only(bad)


# -- the engine loop over sockets ---------------------------------------------------------


class LoopHarness:
    """An EngineLoop in a thread, wired with inproc sockets."""

    def __init__(self, core, telemetry_interval=0.1):
        self.ctx = zmq.Context()
        ctx = self.ctx
        self.to_engine = ctx.socket(zmq.PUSH)
        self.to_engine.bind("inproc://in")
        self.from_engine = ctx.socket(zmq.PULL)
        self.from_engine.bind("inproc://out")
        inp = ctx.socket(zmq.PULL)
        inp.connect("inproc://in")
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.SNDTIMEO, 200)
        out.connect("inproc://out")
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 2)
        pub.bind("inproc://telemetry")
        router = ctx.socket(zmq.ROUTER)
        router.bind("inproc://control")
        self.sockets = [inp, out, pub, router]
        self.loop = EngineLoop(
            core,
            input_sock=inp,
            output_sock=out,
            pub_sock=pub,
            control_sock=router,
            token=TOKEN,
            telemetry_interval=telemetry_interval,
        )
        self.rc = None
        self.pending = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        self.rc = self.loop.run()

    def send(self, msg):
        self.to_engine.send(wire.encode(msg))

    def recv(self, kind, timeout=5.0):
        """The next message of ``kind``; messages of other kinds are kept for later."""
        for i, msg in enumerate(self.pending):
            if isinstance(msg, kind):
                return self.pending.pop(i)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.from_engine.poll(100):
                msg = wire.decode_from_engine(self.from_engine.recv())
                if isinstance(msg, kind):
                    return msg
                self.pending.append(msg)
        raise TimeoutError(f"no {kind.__name__} from the engine loop")

    def close(self):
        if self.thread.is_alive():
            self.send(wire.Shutdown())
            self.thread.join(5)
        for s in (*self.sockets, self.to_engine, self.from_engine):
            s.close(linger=0)
        self.ctx.term()


def submit(h, rid, prompt, **sp):
    params = {"max_tokens": 4, "temperature": 0.0, **sp}
    h.send(
        wire.SubmitRequest(
            EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params)
        )
    )


def collect(h, rids, timeout=5.0):
    tokens = {rid: [] for rid in rids}
    done = set()
    while done != set(rids):
        batch = h.recv(wire.OutputBatch, timeout)
        for out in batch.outputs:
            if out.request_id in tokens:
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finish_reason:
                    done.add(out.request_id)
    return tokens


def test_a_request_the_engine_refuses_fails_alone():
    h = LoopHarness(make_core())
    try:
        submit(h, "good-1", [5, 6, 7])
        submit(h, "bad", [5, 9999])  # outside the vocabulary: the engine's own check
        submit(h, "bad-params", [5], no_such_param=1)
        submit(h, "good-2", [8, 9], max_tokens=3)
        failed = {h.recv(wire.RequestFailed).request_id for _ in range(2)}
        assert failed == {"bad", "bad-params"}
        tokens = collect(h, ["good-1", "good-2"])
        assert [len(tokens["good-1"]), len(tokens["good-2"])] == [4, 3]
        assert h.thread.is_alive()
    finally:
        h.close()
    assert h.rc == 0


def test_control_and_telemetry_through_the_client_classes():
    core = make_core()
    h = LoopHarness(core, telemetry_interval=0.1)
    try:
        with (
            TelemetrySubscriber("inproc://telemetry", context=h.ctx) as sub,
            AdminClient("inproc://control", TOKEN, client_name="tester", context=h.ctx) as admin,
        ):
            first = sub.recv(timeout=3)
            assert first is not None and first.config["max_num_batched_tokens"] == 64
            res = admin.command(SetConfig("max_num_batched_tokens", 16))
            assert res == {"name": "max_num_batched_tokens", "old": 64, "new": 16}
            # The change is published at once, not at the next tick only.
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                snap = sub.recv(timeout=1)
                if snap.config["max_num_batched_tokens"] == 16:
                    break
            assert snap.config["max_num_batched_tokens"] == 16
            # Who: the client's name, then the uid and pid (inproc has no peer credentials:
            # what the client reported).
            who = f"tester (uid {os.getuid()}, pid {os.getpid()}, reported)"
            assert any(e.kind == "config" and e.data["client"] == who for e in snap.events)
            with pytest.raises(AdminError) as ei:
                admin.command(SetConfig("max_num_seqs", 10_000))
            assert ei.value.kind == "invalid_value"
            with AdminClient("inproc://control", "bad", context=h.ctx) as intruder:
                with pytest.raises(AdminError) as ei:
                    intruder.command(GetStatus())
                assert ei.value.kind == "unauthorized"
            with AdminClient("inproc://control", None, context=h.ctx) as reader:
                assert reader.read_only
                with pytest.raises(AdminError) as ei:
                    reader.command(GetStatus())
                assert ei.value.kind == "no_token"
    finally:
        h.close()


def test_telemetry_rate_is_bounded_and_sequence_numbers_grow():
    core = make_core()
    h = LoopHarness(core, telemetry_interval=0.1)
    try:
        with TelemetrySubscriber("inproc://telemetry", conflate=False, context=h.ctx) as sub:
            sub.recv(timeout=3)
            t0 = time.monotonic()
            seqs = []
            while time.monotonic() - t0 < 1.0:
                frame = sub.recv_raw(timeout=0.5)
                if frame:
                    seqs.append(decode_snapshot(frame).seq)
            assert 5 <= len(seqs) <= 13  # ~10 Hz
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    finally:
        h.close()


def test_a_stalled_subscriber_never_blocks_the_engine():
    core = make_core()
    h = LoopHarness(core, telemetry_interval=0.001)
    try:
        stalled = h.ctx.socket(zmq.SUB)
        stalled.setsockopt(zmq.RCVHWM, 1)
        stalled.setsockopt(zmq.SUBSCRIBE, b"")
        stalled.connect("inproc://telemetry")  # never read
        time.sleep(0.2)
        rids = [f"r{i}" for i in range(20)]
        for rid in rids:
            submit(h, rid, [3, 4, 5], max_tokens=8)
        tokens = collect(h, rids, timeout=10)
        assert all(len(t) == 8 for t in tokens.values())
        stalled.close(linger=0)
    finally:
        h.close()


def test_a_failing_step_reports_dead_and_stops_the_loop(monkeypatch):
    monkeypatch.setenv("PAGECTL_FAKE_CRASH_AFTER_STEPS", "3")
    core = make_core()
    h = LoopHarness(core)
    try:
        with TelemetrySubscriber("inproc://telemetry", context=h.ctx) as sub:
            sub.recv(timeout=3)
            submit(h, "victim", [3, 4, 5], max_tokens=50)
            dead = h.recv(wire.EngineDead)
            assert "injected failure" in dead.message
            h.thread.join(5)
            assert h.rc == 1
            snap = sub.recv(timeout=2)
            assert snap.engine_state == "dead"
    finally:
        h.close()


def test_admin_client_times_out_when_nobody_answers(tmp_path):
    with AdminClient(f"ipc://{tmp_path}/nobody.sock", TOKEN) as c:
        t0 = time.monotonic()
        with pytest.raises(AdminError) as ei:
            c.command(GetStatus(), timeout=0.3)
    assert ei.value.kind == "timeout"
    assert time.monotonic() - t0 < 2
