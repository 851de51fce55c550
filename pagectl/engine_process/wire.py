"""Messages between the API server process and the engine-core process.

Internal to one daemon (the public admin contract is ``protocol.py``). Two ZMQ PUSH/PULL
pairs, both bound by the API server on ``ipc://`` paths in its 0700 runtime directory and
connected by the engine process:

- API server -> engine: ``ToEngine`` (one msgpack frame per message).
- engine -> API server: ``FromEngine`` (one msgpack frame per message).

Each is a tagged union on the field ``t``. Nothing here is ever pickled.
"""

from __future__ import annotations

import msgspec

from pagectl.engine.outputs import EngineCoreOutput, EngineRequest
from pagectl.engine.telemetry import Counters, ModelInfo

# -- API server -> engine -------------------------------------------------------------------


class SubmitRequest(msgspec.Struct, tag="add", tag_field="t"):
    """A validated, tokenized request. The engine validates again (second line of defence);
    a refusal comes back as ``RequestFailed`` and fails only this request."""

    request: EngineRequest


class AbortRequests(msgspec.Struct, tag="abort", tag_field="t"):
    """Abort requests (all their samples); unknown ids are ignored."""

    request_ids: list[str]


class FinishStopString(msgspec.Struct, tag="stop_string", tag_field="t"):
    """The API server's detokenizer found a stop string: finish that sequence now."""

    request_id: str
    index: int
    stop: str


class SetDraining(msgspec.Struct, tag="draining", tag_field="t"):
    """Report engine_state "draining" (SIGTERM received) in telemetry and status."""

    draining: bool


class Shutdown(msgspec.Struct, tag="shutdown", tag_field="t"):
    """Leave the loop, release the model and exit 0."""


ToEngine = SubmitRequest | AbortRequests | FinishStopString | SetDraining | Shutdown


# -- engine -> API server -------------------------------------------------------------------


class EngineReady(msgspec.Struct, tag="ready", tag_field="t", kw_only=True):
    """Handshake: the engine is built and its admin sockets are bound."""

    pid: int
    # Name the API serves and accepts, and where the weights came from.
    model_name: str
    model_path: str
    # Where the API server loads the tokenizer from (None: the model has none).
    tokenizer_path: str | None
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    model_info: ModelInfo
    # Default sampling parameters (SamplingParams field -> value) from the model's
    # generation_config.json; a request's own values win.
    sampling_defaults: dict[str, int | float] = {}
    # The live config at start (snake_case names, as in ``Scheduler.live_config``).
    config: dict[str, int | float | str | bool]
    # Admin endpoints actually bound (a tcp "*" port resolved).
    telemetry_endpoint: str
    control_endpoint: str


class EngineStartFailed(msgspec.Struct, tag="start_failed", tag_field="t"):
    """The engine could not be built; the daemon exits non-zero with this message."""

    message: str


class OutputBatch(msgspec.Struct, tag="outputs", tag_field="t"):
    """Outputs of one step, in the engine's order (per sequence, tokens arrive in order)."""

    outputs: list[EngineCoreOutput]


class RequestFailed(msgspec.Struct, tag="failed", tag_field="t"):
    """A submitted request was refused by the engine; nothing of it is left in the engine."""

    request_id: str
    message: str


class EngineStats(msgspec.Struct, tag="stats", tag_field="t", kw_only=True):
    """Compact engine figures for /metrics and /health, sent at the telemetry rate."""

    engine_state: str
    num_running: int
    num_waiting: int
    num_blocks: int
    num_used_blocks: int
    num_cached_free_blocks: int
    # Token slots in the pool, and slots in used blocks that hold live tokens.
    num_token_slots: int
    num_used_token_slots: int
    counters: Counters
    config: dict[str, int | float | str | bool]
    # KV-event batches sent, and dropped because the publisher's queue was full (0 when
    # --kv-events-config is off).
    kv_events_published: int = 0
    kv_events_dropped: int = 0


class EngineDead(msgspec.Struct, tag="dead", tag_field="t"):
    """The engine loop hit a fatal error and is exiting non-zero."""

    message: str


FromEngine = (
    EngineReady | EngineStartFailed | OutputBatch | RequestFailed | EngineStats | EngineDead
)

to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_engine(frame: bytes) -> ToEngine:
    return to_engine_decoder.decode(frame)


def decode_from_engine(frame: bytes) -> FromEngine:
    return from_engine_decoder.decode(frame)
