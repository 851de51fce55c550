"""Admin commands the engine core applies between steps, and their replies.

Boundary type: sent by ``pagectl ctl`` / ``pagectl top`` over the control socket as msgpack
(a tagged union on the field ``cmd``), applied by ``EngineCore.apply_command``.
"""

from __future__ import annotations

import msgspec


class SetConfig(msgspec.Struct, tag="set", tag_field="cmd"):
    """Change one live setting (see ``scheduler.LIVE_SETTINGS``); snake_case or kebab-case."""

    name: str
    # Integers for budgets and caps; booleans (or "on"/"off") for switches.
    value: int | bool | str


class SetPrefixCaching(msgspec.Struct, tag="prefix_cache", tag_field="cmd"):
    """Turn prefix caching on or off (off releases cached-but-unused blocks)."""

    enabled: bool


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", tag_field="cmd"):
    """Forget every cached prefix; running requests keep their blocks."""


class Pause(msgspec.Struct, tag="pause", tag_field="cmd"):
    """Stop admitting waiting requests; running ones go on."""


class Resume(msgspec.Struct, tag="resume", tag_field="cmd"):
    """Admit waiting requests again."""


class Abort(msgspec.Struct, tag="abort", tag_field="cmd"):
    """Abort a request (all its samples) wherever it is: waiting, running, mid-chunk."""

    request_id: str


class GetStatus(msgspec.Struct, tag="status", tag_field="cmd"):
    """Config, KV usage, counters and requests, as a plain dict."""


class InspectBlock(msgspec.Struct, tag="inspect_block", tag_field="cmd"):
    """One block's refcount, owners, fill, hash and tokens."""

    block_id: int


class InspectRequest(msgspec.Struct, tag="inspect_request", tag_field="cmd"):
    """One live request's sequences and their token ids (``engine/inspect.py``), bounded."""

    request_id: str
    # Only this sequence (its seq id: "id", "id#2", "id#b3"); "" for all of the request's.
    seq_id: str = ""
    # Token ids returned per list (the prompt, each sequence's output), at most
    # ``inspect.MAX_INSPECT_TOKENS``; a longer list keeps its head and tail.
    max_tokens: int = 1024


Command = (
    SetConfig
    | SetPrefixCaching
    | ResetPrefixCache
    | Pause
    | Resume
    | Abort
    | GetStatus
    | InspectBlock
    | InspectRequest
)


class CommandError(Exception):
    """A refused command. ``kind`` is one of: invalid_value, unknown_setting, not_found,
    unknown_command, unauthorized, engine_dead, timeout."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
