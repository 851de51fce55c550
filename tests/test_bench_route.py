"""``pagectl bench route``: its workload and the figures it derives from /metrics."""

from __future__ import annotations

import argparse

from pagectl.bench.route import add_arguments, delta, workload


def test_workload_interleaves_shared_system_prompts():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--system-prompts", "3", "--turns", "4", "--system-len", "20"])
    prompts = workload(args)
    assert len(prompts) == 12 and all(len(x) == 20 + args.user_len for x in prompts)
    systems = [tuple(x[:20]) for x in prompts]
    assert sorted(systems.count(s) for s in set(systems)) == [4, 4, 4]
    assert len({tuple(x) for x in prompts}) == 12  # every user turn differs
    assert workload(args) == prompts  # seeded


def test_delta_sums_over_daemons():
    before = [{"a": 1.0}, {"a": 2.0}]
    after = [{"a": 4.0}, {"a": 3.0, "b": 1.0}]
    assert delta(after, before, "a") == 4.0 and delta(after, before, "b") == 1.0


def test_totals_sum_over_the_engine_label():
    from pagectl.bench.route import parse_totals, per_engine

    text = (
        'pagectl:prefix_cache_hits_total{engine="0"} 32.0\n'
        'pagectl:prefix_cache_hits_total{engine="1"} 16.0\n'
        "pagectl:prefix_cache_queries_total 10.0\n"
        'pagectl:dp_routing_decisions_total{engine="1",reason="prefix"} 3.0\n'
        'pagectl:dp_routing_decisions_total{engine="1",reason="load"} 2.0\n'
        'pagectl:dp_routing_decisions_total{engine="0",reason="load"} 1.0\n'
    )
    totals = parse_totals(text)
    assert totals["pagectl:prefix_cache_hits_total"] == 48.0
    assert totals["pagectl:prefix_cache_queries_total"] == 10.0
    assert per_engine(text, "pagectl:dp_routing_decisions_total") == {"1": 5.0, "0": 1.0}
