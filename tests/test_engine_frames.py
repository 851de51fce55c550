"""The engine loop survives any frame on its control and input sockets.

The nested frame ``b"\\x91" * 2000 + b"\\xc0"`` once made the daemon exit (msgspec raised
``RecursionError`` and nothing caught it). Here it and ten other malformed frames go to the
loop's control socket and to its input socket, and the loop must answer the next command and
serve the next request; then the same frames go to a real daemon's control endpoint.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from test_admin_protocol import TOKEN, LoopHarness, collect, make_core, submit

from pagectl.control.client import AdminClient
from pagectl.control.protocol import decode_reply
from pagectl.engine.commands import GetStatus
from pagectl.engine_process import wire
from pagectl.engine_process.frames import (
    MAX_CONTROL_FRAME_BYTES,
    FrameError,
    control_request_id,
    decode_frame,
)
from pagectl.testing.daemon_process import DaemonProcess

NESTED = b"\x91" * 2000 + b"\xc0"
_enc = msgspec.msgpack.encode

MALFORMED = [
    NESTED,
    b"",  # empty frame
    b"\xc1",  # a byte msgpack never uses
    b"\xff" * 64,  # negative fixints: not an object
    b"\x83\xa2id",  # truncated map
    b"\x81\xa1a" * 50_000 + b"\xc0",  # maps nested 50,000 deep
    b"\xdd\xff\xff\xff\xff",  # array32 claiming 4 billion items
    b"\xa2\xff\xfe",  # a string that is not UTF-8
    b"\xd4\x01\x00",  # an extension type
    _enc({"id": "seven", "token": 5, "command": []}),  # wrong types
    _enc({"t": "add", "request": {"request_id": 1}}),  # wrong type for the id
]
assert len(MALFORMED) == 11


def test_decode_frame_turns_every_failure_into_frame_error():
    dec = msgspec.msgpack.Decoder()  # untyped: recurses as deep as the frame
    for frame in MALFORMED:
        with pytest.raises(FrameError):
            decode_frame(msgspec.msgpack.Decoder(wire.ToEngine), frame, 1 << 20)
    with pytest.raises(FrameError, match="nested too deeply"):
        decode_frame(dec, NESTED, 1 << 20)
    with pytest.raises(FrameError, match="larger than"):
        decode_frame(dec, _enc({"a": "x" * 100}), 64)
    # The id of a bad request is read when it can be, whatever else the frame holds.
    assert control_request_id(_enc({"id": 41, "command": {"cmd": 3}})) == 41
    assert control_request_id(NESTED) == 0


def _control(sock: zmq.Socket, frame: bytes, timeout_ms: int = 3000):
    sock.send(frame)
    assert sock.poll(timeout_ms), "no reply from the engine loop"
    return decode_reply(sock.recv())


def test_loop_survives_malformed_control_and_input_frames():
    h = LoopHarness(make_core())
    dealer = h.ctx.socket(zmq.DEALER)
    dealer.connect("inproc://control")
    try:
        for frame in MALFORMED:
            reply = _control(dealer, frame)
            assert not reply.ok and reply.error.kind == "bad_request"
            h.to_engine.send(frame)
        # A well-formed envelope whose command is nested 2,000 deep: refused, id kept.
        deep = (
            b"\x84"
            + _enc("id")
            + _enc(7)
            + _enc("token")
            + _enc(TOKEN)
            + _enc("client")
            + _enc("t")
            + _enc("command")
            + NESTED
        )
        reply = _control(dealer, deep)
        assert reply.id == 7 and reply.error.kind == "bad_request"
        # A SubmitRequest whose id can be read fails that request, by id.
        h.to_engine.send(_enc({"t": "add", "request": {"request_id": "r-bad", "x": NESTED}}))
        failed = h.recv(wire.RequestFailed)
        assert failed.request_id == "r-bad" and "malformed" in failed.message
        # The loop is alive: it answers the next command and serves the next request.
        with AdminClient("inproc://control", TOKEN, context=h.ctx) as admin:
            assert admin.command(GetStatus())["engine_state"] in ("idle", "running")
        submit(h, "ok", [5, 6, 7])
        assert len(collect(h, ["ok"])["ok"]) == 4
        assert h.thread.is_alive() and h.rc is None
    finally:
        dealer.close(linger=0)
        h.close()


def test_an_unexpected_error_in_one_message_costs_that_message_only():
    core = make_core()
    h = LoopHarness(core)
    try:
        real = core.scheduler.finish_by_stop_string

        def broken(*a):
            raise KeyError("bug in one handler")

        core.scheduler.finish_by_stop_string = broken
        h.send(wire.FinishStopString("nope", 0, "x"))
        time.sleep(0.2)
        core.scheduler.finish_by_stop_string = real
        submit(h, "after", [5, 6])
        assert len(collect(h, ["after"])["after"]) == 4
        assert h.rc is None
    finally:
        h.close()


def test_an_engine_invariant_failure_is_fatal_and_reported():
    core = make_core()
    h = LoopHarness(core)
    try:

        def broken(*a):
            raise AssertionError("block refcount went negative")

        core.scheduler.finish_by_stop_string = broken
        h.send(wire.FinishStopString("nope", 0, "x"))
        dead = h.recv(wire.EngineDead)
        assert "invariant" in dead.message
        h.thread.join(5)
        assert h.rc == 1
    finally:
        h.close()


def fake_daemon(
    tmp_path_factory, *extra: str, env: dict | None = None, nofile: int | None = None
) -> DaemonProcess:
    """A daemon over the fake model with no tokenizer (starts in seconds: no transformers)."""
    empty = tmp_path_factory.mktemp("no-tokenizer")
    return DaemonProcess(
        tmp_path_factory.mktemp("run"),
        [
            "--tokenizer",
            str(empty),
            "--engine-factory",
            "pagectl.testing.fake_engine:fake_engine",
            "--num-kv-blocks",
            "32",
            *extra,
        ],
        env=env,
        nofile=nofile,
    )


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = fake_daemon(tmp_path_factory)
    d.start()
    yield d
    d.kill()


def test_daemon_survives_malformed_control_frames_with_no_token(daemon):
    info = daemon.info
    ctx = zmq.Context()
    try:
        for frame in [*MALFORMED, b"\x00" * (MAX_CONTROL_FRAME_BYTES + 1)]:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(info.control_endpoint)
            s.send(frame)
            if len(frame) <= MAX_CONTROL_FRAME_BYTES:
                assert s.poll(3000)
                assert decode_reply(s.recv()).error.kind == "bad_request"
            s.close()
        time.sleep(0.3)
        assert daemon.proc.poll() is None
        out = daemon.ctl("status")
        assert out.returncode == 0, out.stderr
        assert daemon.health() == 200
    finally:
        ctx.term()
