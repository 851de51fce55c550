"""The fleet's numbers and its skew verdict: which member (a data-parallel engine, or a daemon
behind ``pagectl route``) is hot, and why.

A fleet is a mapping from a member's label ("engine 1", "127.0.0.1:8001") to its snapshot
history, oldest first, one slim snapshot a second as ``pagectl top`` keeps it for the
per-daemon verdicts (``verdicts.slim``). ``member_stats`` reads one member's row of the fleet
table; ``skew_rule`` compares the rows. Like the rules of ``verdicts.py`` they read counter
deltas within the window and the newest snapshot's state, nothing else.

A member is hot when its mean load over the window (running + waiting sequences) is at least
``SKEW_MIN_REQUESTS`` above the least loaded member's and at least ``SKEW_RATIO`` times it.
The cause named is the first that holds, in this order:

1. a hot prefix: the hot member serves most of its prompt tokens from the prefix cache and
   took a share of the fleet's new requests well above an even one (prefix affinity sends a
   popular prefix where it is cached, up to the router's skew bound);
2. a smaller pool: it has at most ``SMALL_POOL`` of another member's KV blocks;
3. a lower running cap: its ``max_num_seqs`` is below another member's;
4. a longer queue: none of the above; requests wait there longer than elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagectl.control.verdicts import MIN_SPAN_S, WINDOW_S, Verdict, window
from pagectl.engine.telemetry import TelemetrySnapshot

# Load gap (sequences) and load ratio from which a member is called hot.
SKEW_MIN_REQUESTS = 4.0
SKEW_RATIO = 2.0
# A hot prefix: the hot member's prefix hit rate at least this, and its share of the fleet's
# new requests at least this factor above an even share (1 / members).
HOT_PREFIX_HIT_RATE = 0.5
HOT_SHARE_FACTOR = 1.25
# A smaller pool: at most this fraction of another member's blocks.
SMALL_POOL = 0.75
# Seconds the fleet table's rates (tok/s) are taken over.
RATE_S = 5.0


@dataclass(frozen=True)
class MemberStats:
    """One member's row of the fleet table, from its history."""

    label: str
    # The newest snapshot's state.
    engine_state: str
    num_running: int
    num_waiting: int
    num_blocks: int
    # Fraction of blocks in use, 0-1.
    kv_usage: float
    max_num_seqs: int
    # Prefix hit rate over the window (tokens served from cache / tokens looked up); since
    # start when nothing was looked up in the window; None when nothing ever was.
    hit_rate: float | None
    # Generated tokens per second over the last ``RATE_S`` (None: one snapshot only).
    generation_tps: float | None
    # Preemptions since start, and per minute over the window.
    preemptions: int
    preemptions_per_min: float
    # Sequences that arrived within the window (finished + the change in running + waiting),
    # and the mean of running + waiting over it.
    arrivals: int
    mean_load: float
    # Seconds the window spans.
    span_s: float


def _delta_rate(h: Sequence[TelemetrySnapshot], seconds: float) -> float | None:
    recent = window(h, seconds)
    if len(recent) < 2 or recent[-1].time <= recent[0].time:
        return None
    a, b = recent[0], recent[-1]
    return (b.counters.generation_tokens - a.counters.generation_tokens) / (b.time - a.time)


def _finished(snap: TelemetrySnapshot) -> int:
    return sum(snap.counters.finished_by_reason.values())


def member_stats(label: str, history: Sequence[TelemetrySnapshot]) -> MemberStats | None:
    """The fleet row of one member (None: no snapshot yet)."""
    h = window(history, WINDOW_S)
    if not h:
        return None
    first, last = h[0], h[-1]
    span = last.time - first.time if len(h) > 1 else 0.0
    c0, c1 = first.counters, last.counters
    queries = c1.prefix_queries - c0.prefix_queries
    if queries > 0:
        hit_rate: float | None = (c1.prefix_hits - c0.prefix_hits) / queries
    else:
        hit_rate = c1.prefix_hits / c1.prefix_queries if c1.prefix_queries else None
    cap = last.config.get("max_num_seqs", 0)
    preempted = c1.preemptions - c0.preemptions
    return MemberStats(
        label=label,
        engine_state=last.engine_state,
        num_running=last.num_running,
        num_waiting=last.num_waiting,
        num_blocks=last.blocks.num_blocks,
        kv_usage=last.num_used_blocks / max(1, last.blocks.num_blocks),
        max_num_seqs=cap if isinstance(cap, int) and not isinstance(cap, bool) else 0,
        hit_rate=hit_rate,
        generation_tps=_delta_rate(h, RATE_S),
        preemptions=c1.preemptions,
        preemptions_per_min=preempted * 60.0 / span if span > 0 else 0.0,
        arrivals=max(
            0,
            _finished(last)
            - _finished(first)
            + last.num_running
            + last.num_waiting
            - first.num_running
            - first.num_waiting,
        ),
        mean_load=sum(s.num_running + s.num_waiting for s in h) / len(h),
        span_s=span,
    )


@dataclass(frozen=True)
class SkewVerdict(Verdict):
    """A skew finding: the member that is hot and why."""

    # The hot member's label, and the one least loaded.
    member: str = ""
    coolest: str = ""
    # "hot_prefix", "smaller_pool", "running_cap" or "queue".
    cause: str = ""
    # The finding in a few words, for a narrow terminal ("engine 0 is hot: a hot prefix
    # (88% hit rate, 80% of new requests)").
    summary: str = ""


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def skew_rule(histories: Mapping[str, Sequence[TelemetrySnapshot]]) -> SkewVerdict | None:
    """The skew verdict on a fleet (label -> history, oldest first), or None when the load
    is even, fewer than two members have a judged window, or the windows are too short."""
    rows = [member_stats(label, h) for label, h in histories.items()]
    stats = [r for r in rows if r is not None and r.span_s >= MIN_SPAN_S]
    if len(stats) < 2:
        return None
    hot = max(stats, key=lambda r: r.mean_load)
    cool = min(stats, key=lambda r: r.mean_load)
    if (
        hot.mean_load - cool.mean_load < SKEW_MIN_REQUESTS
        or hot.mean_load < SKEW_RATIO * cool.mean_load
    ):
        return None
    others = [r for r in stats if r is not hot]
    lead = (
        f"{hot.label} is hot: {hot.mean_load:.0f} requests running or waiting on average "
        f"against {cool.mean_load:.0f} on {cool.label}"
    )
    total = sum(r.arrivals for r in stats)
    share = hot.arrivals / total if total else 0.0
    biggest = max(others, key=lambda r: r.num_blocks)
    widest = max(others, key=lambda r: r.max_num_seqs)
    if (
        hot.hit_rate is not None
        and hot.hit_rate >= HOT_PREFIX_HIT_RATE
        and share >= HOT_SHARE_FACTOR / len(stats)
    ):
        cause, knob = "hot_prefix", "max-skew"
        short = f"a hot prefix ({_pct(hot.hit_rate)} hit rate, {share:.0%} of new requests)"
        why = (
            f"a hot prefix: {_pct(hot.hit_rate)} prefix hit rate, {share:.0%} of new requests "
            "— lower the routing skew bound (max-skew) to spread it"
        )
    elif hot.num_blocks <= SMALL_POOL * biggest.num_blocks:
        cause, knob = "smaller_pool", "kv-cache-memory"
        short = f"a smaller pool ({hot.num_blocks} blocks against {biggest.num_blocks})"
        why = (
            f"a smaller pool: {hot.num_blocks} blocks against {biggest.num_blocks} on "
            f"{biggest.label} (KV {_pct(hot.kv_usage)} used) — give it more --kv-cache-memory"
        )
    elif hot.max_num_seqs < widest.max_num_seqs:
        cause, knob = "running_cap", "max-num-seqs"
        short = f"a lower running cap ({hot.max_num_seqs} against {widest.max_num_seqs})"
        why = (
            f"a lower running cap: max-num-seqs {hot.max_num_seqs} against "
            f"{widest.max_num_seqs} on {widest.label} — raise it"
        )
    else:
        cause, knob = "queue", "routing"
        shortest = min(others, key=lambda r: r.num_waiting)
        short = f"a longer queue ({hot.num_waiting} waiting against {shortest.num_waiting})"
        why = (
            f"a longer queue: {hot.num_waiting} waiting against {shortest.num_waiting} on "
            f"{shortest.label} — route by load"
        )
    return SkewVerdict(
        "skew",
        knob,
        f"{lead} — {why}",
        hot.label,
        cool.label,
        cause,
        f"{hot.label} is hot: {short}",
    )
