"""Verdicts that name the knob: small rules over the last minute of telemetry snapshots.

Each rule is a function ``(history) -> Verdict | None`` over snapshots oldest first (as
``pagectl top`` receives them, or as a ``--record`` file holds them) and reads only counter
deltas between the window's first and last snapshot, and the last snapshot's state. The
console shows the verdicts (``pagectl.tui``), ``pagectl ctl status`` prints them.

``slim`` drops what no rule reads (block arrays, block tables, events), so that a console
can keep a minute of history of a large pool cheaply.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from pagectl.engine.telemetry import BlockMap, TelemetrySnapshot

# The window rules read, in seconds, and the shortest history they judge at all.
WINDOW_S = 60.0
MIN_SPAN_S = 2.0
# Preemptions per minute from which the running cap is blamed.
PREEMPTIONS_PER_MIN = 3.0
# Prefix caching: a hit rate under this, on at least this share of the pool held as cache,
# over at least this many looked-up tokens, is not worth its memory.
LOW_HIT_RATE = 0.05
CACHE_SHARE = 0.3
MIN_QUERIED_TOKENS = 256
# The waiting queue growing faster than this (requests/s) is reported.
QUEUE_GROWTH_PER_S = 0.5


@dataclass(frozen=True)
class Verdict:
    """One finding and what to change."""

    # The rule's name ("preemption", "prefix_cache", "queue").
    rule: str
    # The knob to turn, as the operator types it ("max-num-seqs", "prefix-caching",
    # "max-num-batched-tokens", "kv-cache-memory").
    knob: str
    # One line for people, the knob named in it.
    message: str


def slim(snap: TelemetrySnapshot) -> TelemetrySnapshot:
    """The snapshot without what rules never read (block arrays, block tables, events)."""
    b = snap.blocks
    return msgspec.structs.replace(
        snap,
        blocks=BlockMap(b.num_blocks, b.block_size, b"", b""),
        requests=[msgspec.structs.replace(r, block_ids=b"") for r in snap.requests],
        events=[],
        steps=snap.steps[-1:],
    )


def window(history: Sequence[TelemetrySnapshot], seconds: float = WINDOW_S):
    """The snapshots of the last ``seconds`` (of the newest daemon, if it restarted)."""
    if not history:
        return []
    last = history[-1]
    return [s for s in history if s.start_time == last.start_time and s.time >= last.time - seconds]


def _span(h: Sequence[TelemetrySnapshot]) -> float:
    return h[-1].time - h[0].time if len(h) > 1 else 0.0


def _int(cfg: dict, key: str) -> int:
    v = cfg.get(key, 0)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def preemption_rule(history: Sequence[TelemetrySnapshot]) -> Verdict | None:
    """Preempting often: the running cap needs more blocks than the pool holds at the current
    sequence lengths. Names the cap that would fit."""
    h = window(history)
    span = _span(h)
    if span < MIN_SPAN_S:
        return None
    first, last = h[0], h[-1]
    n = last.counters.preemptions - first.counters.preemptions
    per_min = n * 60.0 / span
    if per_min < PREEMPTIONS_PER_MIN:
        return None
    bs = last.blocks.block_size
    lengths = [r.num_prompt_tokens + r.num_output_tokens for r in last.requests]
    if not lengths:
        return None
    blocks_per_seq = max(1.0, sum(math.ceil((x + 1) / bs) for x in lengths) / len(lengths))
    cap = _int(last.config, "max_num_seqs")
    pool = last.blocks.num_blocks
    needed = math.ceil(cap * blocks_per_seq)
    fits = max(1, int(pool // blocks_per_seq))
    if fits >= cap:
        # The cap itself fits on average: long sequences collide; a lower cap still helps.
        fits = max(1, cap * 3 // 4)
    return Verdict(
        "preemption",
        "max-num-seqs",
        f"preempting {per_min:.0f}/min: KV pool holds {pool} blocks, running cap {cap} needs "
        f"~{needed} at current lengths — lower max-num-seqs to {fits} or raise "
        "--kv-cache-memory",
    )


def prefix_cache_rule(history: Sequence[TelemetrySnapshot]) -> Verdict | None:
    """Prefix caching on, little reuse, and much of the pool held as cache."""
    h = window(history)
    if _span(h) < MIN_SPAN_S:
        return None
    first, last = h[0], h[-1]
    if not last.config.get("enable_prefix_caching"):
        return None
    queries = last.counters.prefix_queries - first.counters.prefix_queries
    if queries < MIN_QUERIED_TOKENS:
        return None
    rate = (last.counters.prefix_hits - first.counters.prefix_hits) / queries
    share = last.num_cached_free_blocks / max(1, last.blocks.num_blocks)
    if rate >= LOW_HIT_RATE or share < CACHE_SHARE:
        return None
    return Verdict(
        "prefix_cache",
        "prefix-caching",
        f"prefix hit rate {rate:.0%} on {share:.0%} of the pool held as cache: turn prefix "
        "caching off (pagectl ctl prefix-cache off)",
    )


def queue_rule(history: Sequence[TelemetrySnapshot]) -> Verdict | None:
    """The waiting queue grows: says which limit holds admission back."""
    h = window(history)
    span = _span(h)
    if span < MIN_SPAN_S:
        return None
    first, last = h[0], h[-1]
    growth = (last.num_waiting - first.num_waiting) / span
    if growth < QUEUE_GROWTH_PER_S or last.num_waiting == 0:
        return None
    cap = _int(last.config, "max_num_seqs")
    usage = last.num_used_blocks / max(1, last.blocks.num_blocks)
    step = last.steps[-1] if last.steps else None
    if last.config.get("paused"):
        knob, advice = "resume", "admission is paused (pagectl ctl resume)"
    elif last.num_running >= cap and usage < 0.8:
        knob, advice = "max-num-seqs", f"raise max-num-seqs above {cap} (KV {usage:.0%} used)"
    elif step is not None and step.num_scheduled_tokens >= step.token_budget:
        knob = "max-num-batched-tokens"
        advice = (
            f"every step uses its {step.token_budget}-token budget: raise max-num-batched-tokens"
        )
    else:
        knob, advice = "kv-cache-memory", f"KV {usage:.0%} used: raise --kv-cache-memory"
    return Verdict(
        "queue",
        knob,
        f"queue grows {growth:.1f} req/s faster than it drains ({last.num_waiting} waiting): "
        + advice,
    )


RULES: tuple[Callable[[Sequence[TelemetrySnapshot]], Verdict | None], ...] = (
    preemption_rule,
    prefix_cache_rule,
    queue_rule,
)


def verdicts(history: Sequence[TelemetrySnapshot]) -> list[Verdict]:
    """Every rule's verdict on ``history`` (oldest first), in rule order."""
    out = []
    for rule in RULES:
        v = rule(history)
        if v is not None:
            out.append(v)
    return out
