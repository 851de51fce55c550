"""The fleet's skew verdict on recorded histories: engine cores (fake model) fed uneven load,
their snapshots written in the ``--record`` format and read back, one history per member."""

from __future__ import annotations

from test_tui_scenarios import SYSTEM_PROMPT, Recorder, make_core
from test_verdicts import recorded

from pagectl.control.skew import member_stats, skew_rule
from pagectl.engine.commands import Pause


def run_fleet(recs: dict[str, Recorder], feed, seconds: int, steps: int = 2) -> None:
    """One snapshot a simulated second per member: ``feed(k, label, rec)`` adds requests,
    then every member runs ``steps`` steps."""
    for rec in recs.values():
        rec.take()
    for k in range(seconds):
        for label, rec in recs.items():
            feed(k, label, rec)
            rec.run(steps)


def unrelated(k: int, n: int) -> list[int]:
    """Prompt ``k`` of ``n`` tokens, sharing no block with another."""
    return [(97 * k + 31 * (j // 16) + j) % 1900 + 50 for j in range(n)]


def histories(tmp_path, recs: dict[str, Recorder]):
    out = {}
    for i, (label, rec) in enumerate(recs.items()):
        d = tmp_path / f"m{i}"
        d.mkdir()
        out[label] = recorded(d, rec)
    return out


def test_a_hot_prefix_names_the_engine_and_its_hit_rate(tmp_path):
    recs = {"engine 0": Recorder(make_core(num_blocks=256)), "engine 1": Recorder(make_core())}

    def feed(k, label, rec):
        if label == "engine 0":  # the popular system prompt, routed where it is cached
            rec.add(f"hot{k}", SYSTEM_PROMPT + [500 + k] * 3, max_tokens=60)
        elif k % 4 == 0:
            rec.add(f"cold{k}", [700 + k + j for j in range(20)], max_tokens=6)

    run_fleet(recs, feed, 12)
    h = histories(tmp_path, recs)
    v = skew_rule(h)
    assert v is not None, [member_stats(k, x) for k, x in h.items()]
    assert (v.member, v.coolest, v.cause, v.knob) == (
        "engine 0",
        "engine 1",
        "hot_prefix",
        "max-skew",
    )
    hot = member_stats("engine 0", h["engine 0"])
    assert hot is not None and hot.hit_rate is not None and hot.hit_rate > 0.8
    assert v.message.startswith("engine 0 is hot: ")
    assert f"a hot prefix: {hot.hit_rate:.0%} prefix hit rate, " in v.message
    assert "% of new requests" in v.message
    assert v.summary == f"engine 0 is hot: a hot prefix ({hot.hit_rate:.0%} hit rate, " + (
        v.message.split("prefix hit rate, ")[1].split(" of new")[0] + " of new requests)"
    )


def test_a_smaller_pool_is_named_with_both_sizes(tmp_path):
    recs = {
        "127.0.0.1:8000": Recorder(make_core(num_blocks=256)),
        "127.0.0.1:8001": Recorder(make_core(num_blocks=40)),
    }

    def feed(k, label, rec):  # the same unrelated load on both: 8 blocks a prompt
        for i in range(4):
            rec.add(f"u{k}-{i}", unrelated(4 * k + i, 120), max_tokens=8)

    run_fleet(recs, feed, 12, steps=4)
    v = skew_rule(histories(tmp_path, recs))
    assert v is not None
    assert (v.member, v.cause, v.knob) == ("127.0.0.1:8001", "smaller_pool", "kv-cache-memory")
    assert "a smaller pool: 40 blocks against 256 on 127.0.0.1:8000" in v.message


def test_a_lower_running_cap_and_a_longer_queue(tmp_path):
    recs = {
        "engine 0": Recorder(make_core(num_blocks=256, max_seqs=16)),
        "engine 1": Recorder(make_core(num_blocks=256, max_seqs=2)),
    }

    def feed(k, label, rec):
        for i in range(3):
            rec.add(f"r{k}-{i}", unrelated(3 * k + i, 20), max_tokens=8)

    run_fleet(recs, feed, 12, steps=4)
    v = skew_rule(histories(tmp_path, recs))
    assert v is not None and (v.member, v.cause) == ("engine 1", "running_cap")
    assert "max-num-seqs 2 against 16 on engine 0" in v.message

    # Three members alike but one behind a paused admission: only its queue differs.
    recs = {f"engine {i}": Recorder(make_core(num_blocks=256)) for i in range(3)}
    recs["engine 2"].core.apply_command(Pause(), "test")
    run_fleet(recs, feed, 8, steps=4)
    (tmp_path / "b").mkdir()
    v = skew_rule(histories(tmp_path / "b", recs))
    assert v is not None and (v.member, v.cause, v.knob) == ("engine 2", "queue", "routing")
    assert "a longer queue: " in v.message and " waiting against 0 on engine " in v.message


def test_even_load_and_short_histories_are_no_verdict(tmp_path):
    recs = {f"engine {i}": Recorder(make_core(num_blocks=256)) for i in range(2)}

    def feed(k, label, rec):
        rec.add(f"e{k}", SYSTEM_PROMPT + [k + 3], max_tokens=8)

    run_fleet(recs, feed, 10)
    h = histories(tmp_path, recs)
    assert skew_rule(h) is None
    # One member, or windows under two seconds: nothing to compare.
    assert skew_rule({"engine 0": h["engine 0"]}) is None
    assert skew_rule({k: x[:2] for k, x in h.items()}) is None
    s = member_stats("engine 0", h["engine 0"])
    assert s is not None and s.arrivals == 10 and s.generation_tps is not None
    assert member_stats("engine 9", []) is None
