"""The live settings the console steers, and how one key press moves them."""

from __future__ import annotations

from dataclasses import dataclass

from pagectl.engine.live_config import LIVE_SETTINGS, LiveSetting


@dataclass(frozen=True)
class Knob:
    """A live integer setting of the scheduler, as the console steps it (from its entry in
    ``LIVE_SETTINGS``)."""

    # snake_case name, as in the daemon's config and ``SetConfig``.
    name: str
    # Short label for notices and the palette.
    label: str
    # Config key holding the upper limit (None: unbounded), and the lower limit.
    limit_key: str | None
    low: int
    # Values are rounded to multiples of this once they are big enough.
    granularity: int
    help: str

    @classmethod
    def of(cls, s: LiveSetting) -> Knob:
        return cls(s.name, s.label, s.limit_key, s.low, s.granularity, s.description)


# Every live integer setting, in the table's order.
KNOBS = tuple(Knob.of(s) for s in LIVE_SETTINGS.values() if s.type is int)
_BY_NAME = {k.name: k for k in KNOBS}
BUDGET = _BY_NAME["max_num_batched_tokens"]
MAX_SEQS = _BY_NAME["max_num_seqs"]

# One key press changes a setting by this factor.
STEP_FACTOR = 1.25


def step(knob: Knob, value: int, direction: int, config: dict) -> int:
    """The value after one ``]`` (direction 1) or ``[`` (direction -1) press.

    Moves by 25%, rounded to the knob's granularity once the value spans a few multiples of
    it, always by at least 1, and stays within the knob's limits.
    """
    target = value * STEP_FACTOR if direction > 0 else value / STEP_FACTOR
    g = knob.granularity
    new = round(target / g) * g if value >= 4 * g else round(target)
    if direction > 0:
        new = max(new, value + 1)
    else:
        new = min(new, value - 1)
    high = config.get(knob.limit_key) if knob.limit_key else None
    if isinstance(high, int) and not isinstance(high, bool):
        new = min(new, high)
    return max(knob.low, new)
