"""Serving one control request: token check, decoding, applying, typed reply.

Runs on the engine loop thread between two steps, so ``EngineCore.apply_command`` never
races a step. Whatever a client sends, the answer is a ``ControlReply``; nothing a client
sends can raise out of here and stop the engine.
"""

from __future__ import annotations

import hmac
import typing

import msgspec

from pagectl.control.protocol import PROTOCOL_VERSION, ControlReply, ErrorInfo, encode
from pagectl.engine.commands import Command, CommandError
from pagectl.engine.core import EngineCore
from pagectl.engine_process.audit import AUDITED_COMMANDS, AuditLog, who
from pagectl.engine_process.frames import (
    MAX_CONTROL_FRAME_BYTES,
    FrameError,
    control_request_id,
    decode_frame,
)

_command_decoder = msgspec.msgpack.Decoder(Command)
# The values of the "cmd" tag the daemon understands.
COMMAND_NAMES = frozenset(t.__struct_config__.tag for t in typing.get_args(Command))


class _Envelope(msgspec.Struct, kw_only=True):
    """A ControlRequest with the command left undecoded: the token is checked first, so an
    unauthorized client learns nothing about which commands exist."""

    id: int
    token: str
    client: str = ""
    command: msgspec.Raw
    version: int = PROTOCOL_VERSION
    uid: int | None = None
    pid: int | None = None


_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


def _error(req_id: int, kind: str, message: str) -> bytes:
    return encode(ControlReply(id=req_id, ok=False, error=ErrorInfo(kind, message)))


class _CommandName(msgspec.Struct):
    """Only the tag of a command that did not decode."""

    cmd: str


_command_name_decoder = msgspec.msgpack.Decoder(_CommandName)


def _command_name(raw: msgspec.Raw) -> str | None:
    try:
        return decode_frame(_command_name_decoder, raw, MAX_CONTROL_FRAME_BYTES).cmd
    except FrameError:
        return None


def handle_control(
    core: EngineCore,
    token: str,
    frame: bytes,
    *,
    peer_address: str | None = None,
    audit: AuditLog | None = None,
) -> tuple[bytes, bool]:
    """Serve one request frame. Returns (reply frame, whether engine state may have changed).

    Every decode is bounded (``frames.decode_frame``): a frame that is too big, malformed or
    nested too deeply gets a ``bad_request`` reply carrying its id when the id can be read.
    ``peer_address`` is libzmq's ``Peer-Address`` of the frame (uid and pid of an ipc peer);
    every authorized command that can change the engine is appended to ``audit``, accepted
    or refused (``pagectl.engine_process.audit``).
    """
    try:
        env = decode_frame(_envelope_decoder, frame, MAX_CONTROL_FRAME_BYTES)
    except FrameError as e:
        return _error(
            control_request_id(frame), "bad_request", f"malformed control request: {e}"
        ), False
    if not hmac.compare_digest(env.token.encode(), token.encode()):
        return _error(env.id, "unauthorized", "wrong or missing control token"), False
    if env.version != PROTOCOL_VERSION:
        return _error(
            env.id,
            "bad_request",
            f"protocol version {env.version} is not supported (daemon speaks {PROTOCOL_VERSION})",
        ), False
    try:
        cmd = decode_frame(_command_decoder, env.command, MAX_CONTROL_FRAME_BYTES)
    except FrameError as e:
        name = _command_name(env.command)
        if name is not None and name not in COMMAND_NAMES:
            known = ", ".join(sorted(COMMAND_NAMES))
            return _error(
                env.id, "unknown_command", f"unknown command {name!r}; known: {known}"
            ), False
        return _error(env.id, "bad_request", f"invalid command: {e}"), False
    sender = who(env.client, peer_address, env.uid, env.pid)
    audited = audit is not None and type(cmd).__struct_config__.tag in AUDITED_COMMANDS
    try:
        result = core.apply_command(cmd, sender.label())
    except Exception as e:
        kind, message = (
            (e.kind, e.message)
            if isinstance(e, CommandError)
            else ("internal", f"{type(e).__name__}: {e}")  # a bug must not stop the engine
        )
        if audited:
            assert audit is not None
            audit.record(sender, cmd, kind, message=message)
        return _error(env.id, kind, message), False
    if audited:
        assert audit is not None
        audit.record(sender, cmd, "ok", result=result)
    try:
        reply = encode(ControlReply(id=env.id, ok=True, result=result))
    except (TypeError, msgspec.EncodeError) as e:
        return _error(env.id, "internal", f"result not encodable: {e}"), True
    return reply, True
