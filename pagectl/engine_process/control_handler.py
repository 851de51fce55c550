"""Serving one control request: token check, decoding, applying, typed reply.

Runs on the engine loop thread between two steps, so ``EngineCore.apply_command`` never
races a step. Whatever a client sends, the answer is a ``ControlReply``; nothing a client
sends can raise out of here and stop the engine.
"""

from __future__ import annotations

import hmac
import typing
from typing import Any

import msgspec

from pagectl.control.protocol import PROTOCOL_VERSION, ControlReply, ErrorInfo, encode
from pagectl.engine.commands import Command, CommandError
from pagectl.engine_process.audit import AUDITED_COMMANDS, AuditLog, who

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


def _command_name(raw: msgspec.Raw) -> str | None:
    try:
        obj = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None
    name = obj.get("cmd") if isinstance(obj, dict) else None
    return name if isinstance(name, str) else None


def _guess_id(frame: bytes) -> int:
    """The request id of a malformed request, when it can be read at all (else 0)."""
    try:
        obj = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return 0
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0


def handle_control(
    core: Any,
    token: str,
    frame: bytes,
    *,
    peer_address: str | None = None,
    audit: AuditLog | None = None,
) -> tuple[bytes, bool]:
    """Serve one request frame. Returns (reply frame, whether engine state may have changed).

    ``peer_address`` is libzmq's ``Peer-Address`` of the frame (uid and pid of an ipc peer);
    every authorized command that can change the engine is appended to ``audit``, accepted
    or refused (``pagectl.engine_process.audit``).
    """
    try:
        env = _envelope_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return _error(_guess_id(frame), "bad_request", f"malformed control request: {e}"), False
    if not hmac.compare_digest(env.token.encode(), token.encode()):
        return _error(env.id, "unauthorized", "wrong or missing control token"), False
    if env.version != PROTOCOL_VERSION:
        return _error(
            env.id,
            "bad_request",
            f"protocol version {env.version} is not supported (daemon speaks {PROTOCOL_VERSION})",
        ), False
    try:
        cmd = _command_decoder.decode(env.command)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
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
