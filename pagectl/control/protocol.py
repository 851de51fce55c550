"""The admin channel's wire protocol (msgpack over ZMQ; nothing is ever pickled).

Two sockets, both bound by the engine-core process:

- telemetry: PUB. Each message is ONE frame: ``msgpack(TelemetrySnapshot)`` (see
  ``pagectl.engine.telemetry``), published at a bounded rate with a small send high-water mark,
  so a slow or absent subscriber never blocks the engine. Subscribers subscribe to b"" and
  should set ZMQ_CONFLATE to keep only the newest snapshot.
- control: ROUTER. A client (DEALER) sends ONE frame: ``msgpack(ControlRequest)``; the reply is
  ONE frame: ``msgpack(ControlReply)`` carrying the same ``id``. Commands are applied between
  engine steps. A request without the right token gets ``error.kind == "unauthorized"``.

The daemon writes a ``RuntimeInfo`` JSON file into the runtime directory at start so that
``pagectl top`` / ``pagectl ctl`` find it with no arguments. The full contract, precise
enough to write another client, is docs/ADMIN_PROTOCOL.md.
"""

from __future__ import annotations

import os

import msgspec

from pagectl.engine.commands import Command

PROTOCOL_VERSION = 1


class ControlRequest(msgspec.Struct, kw_only=True):
    """One admin command from a client."""

    # Client-chosen id, echoed in the reply (clients match replies by it).
    id: int
    # The control token read from the daemon's 0600 token file.
    token: str
    # Free-form client name recorded in the audit log (e.g. "ctl@host:pid", "top@host:pid").
    client: str = ""
    # The command (tagged union on its "cmd" field).
    command: Command
    version: int = PROTOCOL_VERSION
    # The sender's uid and pid as it reports them, for the audit log. On ipc:// the daemon
    # records the kernel's peer credentials instead (see docs/ADMIN_PROTOCOL.md).
    uid: int | None = msgspec.field(default_factory=os.getuid)
    pid: int | None = msgspec.field(default_factory=os.getpid)


class ErrorInfo(msgspec.Struct):
    # Sent by the daemon: unauthorized | bad_request | unknown_command | unknown_setting |
    # invalid_value | not_found | internal. Clients may add their own, never sent on the
    # wire (pagectl.control.client: timeout, no_token). See docs/ADMIN_PROTOCOL.md.
    kind: str
    message: str


class ControlReply(msgspec.Struct, kw_only=True):
    """The daemon's answer to one ControlRequest."""

    id: int
    ok: bool
    # Command-specific result (e.g. {"name", "old", "new"} for set) when ok.
    result: dict | None = None
    error: ErrorInfo | None = None
    version: int = PROTOCOL_VERSION


class EngineEndpoints(msgspec.Struct, kw_only=True):
    """One data-parallel engine's admin endpoints."""

    # Data-parallel rank of the engine (0..N-1).
    index: int
    telemetry_endpoint: str
    control_endpoint: str


class RuntimeInfo(msgspec.Struct, kw_only=True):
    """Contents of the daemon's runtime file (JSON)."""

    pid: int
    # time.time() at start.
    start_time: float
    model: str
    # Base URL of the HTTP API, e.g. "http://127.0.0.1:8000".
    http_url: str
    # ZMQ endpoints of the admin channel, e.g. "ipc:///run/user/0/pagectl/8000/telemetry".
    telemetry_endpoint: str
    control_endpoint: str
    # Path of the 0600 file holding the control token.
    token_file: str
    # Tensor-parallel degree of the engine.
    tp_size: int = 1
    # The append-only JSON-lines audit file of accepted control commands ("" before v1.1
    # daemons, which kept none).
    audit_file: str = ""
    # Where clients load the model's tokenizer to show token ids as text ("" when the model
    # has none).
    tokenizer_path: str = ""
    # One entry per engine when the daemon runs N > 1 data-parallel engines (the top-level
    # endpoints are then engine 0's); empty for a single engine.
    engines: list[EngineEndpoints] = []
    # "plain": the telemetry PUB asks subscribers for the control token (ZMQ PLAIN, user
    # "pagectl"; ``control.telemetry_auth``); "": it asks nothing.
    telemetry_auth: str = ""
    version: int = PROTOCOL_VERSION


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(ControlRequest)
_reply_decoder = msgspec.msgpack.Decoder(ControlReply)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_request(frame: bytes) -> ControlRequest:
    return _request_decoder.decode(frame)


def decode_reply(frame: bytes) -> ControlReply:
    return _reply_decoder.decode(frame)
