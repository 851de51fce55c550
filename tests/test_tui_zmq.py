"""The console's ZMQ source against a stand-in daemon speaking the admin protocol."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio
from test_tui_scenarios import huge_snapshot

from pagectl.control.protocol import ControlReply, ErrorInfo, decode_request, encode
from pagectl.engine.commands import CommandError, InspectBlock, SetConfig
from pagectl.engine.telemetry import decode_snapshot, encode_snapshot
from pagectl.tui.zmq_source import Endpoints, ZmqSource


class StandIn:
    """PUB + ROUTER bound on ipc endpoints; answers per ``mode``."""

    def __init__(self, tmp_path, mode: str = "ok") -> None:
        self.ctx = zmq.asyncio.Context()
        self.telemetry = f"ipc://{tmp_path}/telemetry"
        self.control = f"ipc://{tmp_path}/control"
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(self.telemetry)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(self.control)
        self.mode = mode
        self.requests = []
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            ident, frame = await self.router.recv_multipart()
            req = decode_request(frame)
            self.requests.append(req)
            if self.mode == "silent":
                continue
            if self.mode == "late":  # an answer to an older request first
                await self.router.send_multipart(
                    [ident, encode(ControlReply(id=req.id - 1, ok=True, result={}))]
                )
            if req.token != "s3cret":
                reply = ControlReply(
                    id=req.id, ok=False, error=ErrorInfo("unauthorized", "bad token")
                )
            elif isinstance(req.command, SetConfig) and req.command.value == 0:
                reply = ControlReply(
                    id=req.id, ok=False, error=ErrorInfo("invalid_value", "must be >= 1")
                )
            else:
                reply = ControlReply(id=req.id, ok=True, result={"cmd": type(req.command).__name__})
            await self.router.send_multipart([ident, encode(reply)])

    async def close(self) -> None:
        self.task.cancel()
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


@pytest.fixture
def token_file(tmp_path):
    p = tmp_path / "token"
    p.write_text("s3cret\n")
    p.chmod(0o600)
    return str(p)


async def test_telemetry_and_commands(tmp_path, token_file):
    daemon = StandIn(tmp_path, mode="late")
    src = ZmqSource(Endpoints(daemon.telemetry, daemon.control, token_file), client_name="top@test")
    await src.start()
    assert src.can_control and src.read_only_reason == ""
    snap = huge_snapshot(1000, seq=7)
    frame = None
    for _ in range(50):  # the subscription needs a moment to reach the publisher
        await daemon.pub.send(encode_snapshot(snap))
        frame = await src.next_frame(0.05)
        if frame is not None:
            break
    assert frame is not None and decode_snapshot(frame.data).seq == 7
    assert await src.send(InspectBlock(3)) == {"cmd": "InspectBlock"}  # the late reply is skipped
    req = daemon.requests[-1]
    assert (req.token, req.client, req.command) == ("s3cret", "top@test", InspectBlock(3))
    with pytest.raises(CommandError) as e:
        await src.send(SetConfig("max_num_seqs", 0))
    assert (e.value.kind, e.value.message) == ("invalid_value", "must be >= 1")
    await src.close()
    await daemon.close()


async def test_timeout_then_recovery(tmp_path, token_file):
    daemon = StandIn(tmp_path, mode="silent")
    src = ZmqSource(Endpoints(daemon.telemetry, daemon.control, token_file), command_timeout=0.2)
    await src.start()
    with pytest.raises(CommandError) as e:
        await src.send(InspectBlock(0))
    assert e.value.kind == "timeout"
    daemon.mode = "ok"
    assert await src.send(InspectBlock(1)) == {"cmd": "InspectBlock"}
    await src.close()
    await daemon.close()


async def test_read_only_without_a_token(tmp_path):
    src = ZmqSource(
        Endpoints("ipc:///nonexistent/t", "ipc:///nonexistent/c", str(tmp_path / "missing"))
    )
    await src.start()
    assert not src.can_control
    assert src.read_only_reason.startswith("cannot read the control token")
    with pytest.raises(CommandError) as e:
        await src.send(InspectBlock(0))
    assert e.value.kind == "unauthorized"
    await src.close()


async def test_reconnects_to_a_restarted_daemon_at_new_endpoints(tmp_path, token_file):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    current: list[Endpoints] = []

    def resolve() -> Endpoints:
        if not current:
            raise FileNotFoundError("no running pagectl daemon found")
        return current[0]

    src = ZmqSource(resolve, reconnect_after=0.1)
    await src.start()
    assert src.detail == "no running pagectl daemon found" and not src.can_control
    daemon = StandIn(tmp_path / "b")
    current.append(Endpoints(daemon.telemetry, daemon.control, token_file))
    frame = None
    for _ in range(100):
        await daemon.pub.send(encode_snapshot(huge_snapshot(100, seq=3)))
        frame = await src.next_frame(0.05)
        if frame is not None:
            break
    assert frame is not None and src.num_reconnects >= 1
    assert src.label == daemon.telemetry and src.detail == "" and src.can_control
    await src.close()
    await daemon.close()
