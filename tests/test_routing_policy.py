"""The routing policy and the prefix index it reads."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from pagectl.routing.policy import RoutingPolicy, TargetLoad


def hs(*ids: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in ids]


def targets(*loads: int) -> list[TargetLoad]:
    return [TargetLoad(f"t{i}", num_requests=x) for i, x in enumerate(loads)]


def test_round_robin_cycles_over_live_targets():
    p = RoutingPolicy("round_robin")
    ts = targets(0, 9, 0)
    ts[2].alive = False
    picks = [p.choose(ts).index for _ in range(6)]
    assert sorted(Counter(picks).items()) == [(0, 3), (1, 3)]
    for t in ts:
        t.alive = False
    assert p.choose(ts) is None


def test_load_picks_least_loaded_and_spreads_ties():
    p = RoutingPolicy("load")
    assert p.choose(targets(3, 1, 2)).index == 1
    ts = targets(0, 0)
    ts[0].inflight = 2  # the router's own count beats a stale report
    assert p.choose(ts).index == 1
    ties = Counter(p.choose(targets(0, 0, 0)).index for _ in range(30))
    assert ties == {0: 10, 1: 10, 2: 10}


def test_prefix_follows_the_longest_cached_prefix():
    p = RoutingPolicy("prefix")
    p.index.stored("t1", hs(1, 2))
    p.index.stored("t2", hs(1))
    d = p.choose(targets(0, 2, 0), hs(1, 2, 3))
    assert (d.index, d.reason, d.matched_blocks) == (1, "prefix", 2)
    # A chain: a hash past the first miss does not count.
    p.index.stored("t0", hs(2, 3))
    assert p.index.matched_blocks("t0", hs(1, 2, 3)) == 0
    # Removed and cleared blocks stop attracting requests.
    p.index.removed("t1", hs(2))
    p.index.cleared("t2")
    d = p.choose(targets(0, 0, 0), hs(1, 2, 3))
    assert (d.index, d.matched_blocks) == (1, 1)


def test_prefix_respects_the_skew_bound_then_falls_back_to_load():
    p = RoutingPolicy("prefix", max_skew=2)
    p.index.stored("t0", hs(1))
    assert p.choose(targets(2, 0), hs(1)).reason == "prefix"
    d = p.choose(targets(3, 0), hs(1))
    assert (d.index, d.reason) == (1, "skew")
    # No prefix anywhere: load.
    assert p.choose(targets(1, 0), hs(7)).reason == "load"


def test_hot_prefix_spreads_under_the_bound():
    p = RoutingPolicy("prefix", max_skew=1)
    p.index.stored("t0", hs(1))
    ts = targets(0, 0)
    for _ in range(10):  # every request stays in flight
        ts[p.choose(ts, hs(1)).index].inflight += 1
    assert abs(ts[0].inflight - ts[1].inflight) <= 2


def test_decision_inputs_logged_at_debug(caplog):
    p = RoutingPolicy("prefix")
    p.index.stored("t0", hs(1))
    with caplog.at_level(logging.DEBUG, "pagectl.routing"):
        p.choose(targets(0, 0), hs(1, 2))
    assert "t0 load=0 kv=0.00 matched=1/2" in caplog.text and "(prefix)" in caplog.text


def test_bad_settings_refused():
    with pytest.raises(ValueError, match="policy"):
        RoutingPolicy("random")
    with pytest.raises(ValueError, match="max_skew"):
        RoutingPolicy(max_skew=-1)
