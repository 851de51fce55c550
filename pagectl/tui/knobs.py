"""The live settings the console steers, and how one key press moves them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    """A live integer setting of the scheduler."""

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


BUDGET = Knob(
    "max_num_batched_tokens",
    "token budget",
    "max_num_batched_tokens_limit",
    1,
    64,
    "tokens one engine step may schedule (prefill chunks and decodes together)",
)
MAX_SEQS = Knob(
    "max_num_seqs",
    "running cap",
    "max_num_seqs_limit",
    1,
    1,
    "most sequences running at once (up to the start-up value)",
)
LONG_PREFILL = Knob(
    "long_prefill_token_threshold",
    "long-prefill threshold",
    None,
    0,
    64,
    "most prompt tokens one request prefills per step (0: only the budget limits it)",
)
KNOBS = (BUDGET, MAX_SEQS, LONG_PREFILL)

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
