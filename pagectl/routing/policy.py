"""The routing policy: one choice among live targets (daemons behind ``pagectl route``, the
engines of a ``--data-parallel-size`` daemon).

Inputs per target (``TargetLoad``): requests it reports running + waiting, requests the router
has sent it and not seen finish, KV usage; and the request's chain block hashes against the
prefix index. Policies:

- ``round_robin``: the next live target in turn.
- ``load``: the lowest load (``max(reported, in flight)``), then the lower KV usage, ties in
  turn.
- ``prefix``: the target holding the longest prefix of the request's blocks, unless its load
  exceeds the lowest load by more than ``max_skew`` requests (a hot prefix never piles every
  request onto one target); no target holding any block, or the bound exceeded: ``load``.

Every decision's inputs are logged at debug level (logger ``pagectl.routing``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from pagectl.routing.prefix_index import PrefixIndex

log = logging.getLogger("pagectl.routing")

POLICIES = ("prefix", "load", "round_robin")


@dataclass
class TargetLoad:
    # Target name (a backend URL, an engine index).
    name: str
    # Requests the target reported running + waiting (latest stats or scrape).
    num_requests: int = 0
    # Requests sent to it by this router and not finished.
    inflight: int = 0
    # Fraction of its KV blocks in use, 0-1.
    kv_usage: float = 0.0
    # False: not chosen (failed health check, dead engine).
    alive: bool = True

    @property
    def load(self) -> int:
        # The reported figure lags; the router's own count is exact for what it sent.
        return max(self.num_requests, self.inflight)


@dataclass
class Decision:
    # Index into the targets given.
    index: int
    # "prefix", "load", "round_robin", or "skew" (prefix choice refused by the bound).
    reason: str
    # Leading request blocks the chosen target holds.
    matched_blocks: int


class RoutingPolicy:
    def __init__(self, policy: str = "prefix", max_skew: int = 4) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r} (one of {', '.join(POLICIES)})")
        if max_skew < 0:
            raise ValueError("max_skew must be >= 0")
        self.policy = policy
        self.max_skew = max_skew
        self.index = PrefixIndex()
        # The target chosen last; turns and ties start after it.
        self._last = -1

    def choose(
        self, targets: Sequence[TargetLoad], request_hashes: Sequence[bytes] = ()
    ) -> Decision | None:
        """The target for one request, or None when none is alive."""
        live = [i for i, t in enumerate(targets) if t.alive]
        if not live:
            return None
        n = len(targets)
        last = self._last
        # Ties go to the first live target after the last one chosen, so equal loads spread.
        order = sorted(live, key=lambda i: (i - last - 1) % n)
        matched = {i: self.index.matched_blocks(targets[i].name, request_hashes) for i in live}
        if self.policy == "round_robin":
            d = Decision(order[0], "round_robin", matched[order[0]])
        else:
            least = min(order, key=lambda i: (targets[i].load, targets[i].kv_usage))
            d = Decision(least, "load", matched[least])
            if self.policy == "prefix":
                best = max(order, key=lambda i: (matched[i], -targets[i].load))
                if matched[best] > 0:
                    if targets[best].load - targets[least].load <= self.max_skew:
                        d = Decision(best, "prefix", matched[best])
                    else:
                        d.reason = "skew"
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "route -> %s (%s): %s",
                targets[d.index].name,
                d.reason,
                ", ".join(
                    f"{targets[i].name} load={targets[i].load} kv={targets[i].kv_usage:.2f} "
                    f"matched={matched[i]}/{len(request_hashes)}"
                    for i in live
                ),
            )
        self._last = d.index
        return d
