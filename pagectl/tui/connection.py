"""The console's view of its link to the daemon: live, stale, connecting, or a replay."""

from __future__ import annotations

from dataclasses import dataclass

CONNECTING = "connecting"
LIVE = "live"
STALE = "stale"
REPLAY = "replay"
REPLAY_PAUSED = "replay paused"
REPLAY_ENDED = "replay ended"


@dataclass(frozen=True)
class Connection:
    """What the header shows about the link."""

    state: str
    # Where the data comes from (endpoint or file).
    label: str
    # Seconds since the newest frame arrived (None: none yet).
    age: float | None
    # Why nothing comes in, when known.
    detail: str = ""
    # Read-only mode and why ("" when commands can be sent).
    read_only_reason: str = ""
    # Replay: playback speed and position (frames delivered, total, seconds played, total).
    speed: float = 1.0
    position: tuple[int, int, float, float] | None = None
    # Live: seconds the engine has been inside its current step, from the newest heartbeat
    # (0.0: it is between steps, or no heartbeat since the last snapshot).
    busy_s: float = 0.0
