"""Where the console's data comes from: the ``AdminSource`` protocol and its frame type.

The app never talks to ZMQ, files or the engine directly; it is handed an ``AdminSource``.
Three implementations exist:

- ``ZmqSource`` (``zmq_source``): a live daemon's admin channel (SUB telemetry, DEALER control);
- ``ReplaySource`` (``replay_source``): a file written by ``pagectl top --record``;
- ``FakeSource`` (``fake_source``): an in-memory double for tests and demos.

Threading: the app calls every method from its event loop (inside workers); a source never
calls back into the app.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from pagectl.engine.commands import Command


@dataclass(frozen=True)
class Frame:
    """One telemetry message as received."""

    # msgpack(TelemetrySnapshot), exactly as it came off the wire.
    data: bytes
    # time.time() on the console's side when it arrived (the clock telemetry age is measured on).
    received_at: float


class AdminSource(Protocol):
    """A telemetry stream plus (maybe) a control channel."""

    # Where the data comes from, for the header (an endpoint, a file name).
    label: str
    # Why nothing is coming in (no daemon found, ...), for the header; "" when all is well.
    detail: str

    @property
    def can_control(self) -> bool:
        """False in read-only mode: no control token, or a replay."""
        ...

    @property
    def read_only_reason(self) -> str:
        """Why ``can_control`` is False ("" when it is True)."""
        ...

    async def start(self) -> None:
        """Open sockets or files. Must not raise when the daemon is absent."""

    async def next_frame(self, timeout: float) -> Frame | None:
        """The newest telemetry frame, or None when nothing arrived within ``timeout`` s.

        A live source reconnects by itself behind this call when the stream goes quiet.
        """
        ...

    async def send(self, command: Command) -> dict:
        """Send one admin command; return the daemon's result.

        Raises ``CommandError`` (kind ``unauthorized`` in read-only mode, ``timeout`` when the
        daemon does not answer, or the daemon's own refusal).
        """
        ...

    async def close(self) -> None:
        """Release sockets and files."""


@runtime_checkable
class PlaybackControl(Protocol):
    """Extra controls of a recorded stream (``ReplaySource``)."""

    paused: bool
    speed: float
    # True once every recorded frame has been delivered.
    finished: bool

    def now(self) -> float:
        """The playback clock (the recording's timeline), used for telemetry age."""
        ...

    def set_paused(self, paused: bool) -> None: ...

    def set_speed(self, speed: float) -> None: ...

    def position(self) -> tuple[int, int, float, float]:
        """(frames delivered, frames in the file, seconds played, seconds recorded)."""
        ...
