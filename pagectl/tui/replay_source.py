"""Play back a telemetry recording (``pagectl top --replay FILE``) at any speed, with pause.

The recording's own receive times are the timeline: the replay keeps a virtual clock that runs
at ``speed`` times real time (frozen while paused) and delivers the newest frame whose receive
time has been reached, skipping older ones exactly as a conflating live subscriber would.
Telemetry age and staleness are measured on the virtual clock, so a gap in the recording
(the daemon went away) replays as a stale picture.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import time
from collections.abc import Callable
from typing import BinaryIO

from pagectl.engine.commands import Command, CommandError
from pagectl.tui.recording import RecordingIndex
from pagectl.tui.source import Frame

MIN_SPEED = 0.125
MAX_SPEED = 64.0


class ReplaySource:
    """An ``AdminSource`` and ``PlaybackControl`` over a recording file; always read-only."""

    def __init__(
        self, path: str, *, speed: float = 1.0, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = path
        self.label = f"replay {os.path.basename(path)}"
        self.detail = ""
        self.paused = False
        self.speed = _clamp_speed(speed)
        self.finished = False
        self._monotonic = monotonic
        self._index: RecordingIndex | None = None
        self._file: BinaryIO | None = None
        # Index of the next frame to consider; the virtual clock is anchor_t + elapsed * speed.
        self._next = 0
        self._anchor_t = 0.0
        self._anchor_wall = 0.0

    # -- AdminSource ----------------------------------------------------------------------

    @property
    def can_control(self) -> bool:
        return False

    @property
    def read_only_reason(self) -> str:
        return "replay"

    async def start(self) -> None:
        self._index = await asyncio.to_thread(RecordingIndex, self.path)
        self._file = open(self.path, "rb")  # noqa: SIM115 - closed in close()
        self._anchor_t = self._index.times[0] if len(self._index) else 0.0
        self._anchor_wall = self._monotonic()

    async def next_frame(self, timeout: float) -> Frame | None:
        index = self._index
        if index is None or self._file is None:
            raise RuntimeError("ReplaySource.start() was not awaited")
        if self.finished or self.paused:
            await asyncio.sleep(timeout)
            return None
        if self._next >= len(index):
            self.finished = True
            return None
        due_t = index.times[self._next]
        wait = (due_t - self.now()) / self.speed
        if wait > timeout:
            await asyncio.sleep(timeout)
            return None
        if wait > 0:
            await asyncio.sleep(wait)
        # Conflate: jump to the newest frame already due.
        last_due = bisect.bisect_right(index.times, self.now()) - 1
        i = max(self._next, last_due)
        t, data = await asyncio.to_thread(index.read, self._file, i)
        self._next = i + 1
        if self._next >= len(index):
            self.finished = True
        return Frame(data, t)

    async def send(self, command: Command) -> dict:
        raise CommandError("unauthorized", "a replay is read-only")

    async def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- PlaybackControl ------------------------------------------------------------------

    def now(self) -> float:
        """The virtual clock: the recording's time at this instant of the playback."""
        if self.paused:
            return self._anchor_t
        return self._anchor_t + (self._monotonic() - self._anchor_wall) * self.speed

    def _reanchor(self) -> None:
        self._anchor_t = self.now()
        self._anchor_wall = self._monotonic()

    def set_paused(self, paused: bool) -> None:
        if paused != self.paused:
            self._reanchor()
            self.paused = paused

    def set_speed(self, speed: float) -> None:
        self._reanchor()
        self.speed = _clamp_speed(speed)

    def position(self) -> tuple[int, int, float, float]:
        index = self._index
        if index is None or not len(index):
            return 0, 0, 0.0, 0.0
        t0 = index.times[0]
        played = min(max(self.now() - t0, 0.0), index.times[-1] - t0)
        return self._next, len(index), played, index.times[-1] - t0


def _clamp_speed(speed: float) -> float:
    return min(max(float(speed), MIN_SPEED), MAX_SPEED)
