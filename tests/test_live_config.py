"""The live settings table: every reader (scheduler, ctl, console, snapshot, docs) uses it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pagectl.bench.simulate import make_scheduler
from pagectl.cli import ctl
from pagectl.engine.live_config import LIVE_SETTINGS, normalize_name, settings_table
from pagectl.tui.knobs import KNOBS

DOCS = Path(__file__).resolve().parent.parent / "docs" / "ADMIN_PROTOCOL.md"


def test_docs_hold_the_generated_table():
    assert settings_table() in DOCS.read_text(), (
        "docs/ADMIN_PROTOCOL.md's live settings table is stale: paste the output of "
        "python -c 'from pagectl.engine.live_config import settings_table; "
        "print(settings_table())'"
    )


def test_each_setting_is_applied_by_its_own_method_and_read_back():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=100, max_num_seqs=8)
    new = {int: 3, bool: False}
    for s in LIVE_SETTINGS.values():
        before = s.read(sched)
        old, value = sched.set(s.flag, new[s.type], client="t")
        assert (old, value) == (before, new[s.type])
        assert s.read(sched) == new[s.type]
        assert sched.live_config()[s.name] == new[s.type]
        assert sched.events[-1].data["name"] == s.name


def test_bounds_from_the_start_up_values():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=100, max_num_seqs=8)
    cfg = sched.live_config()
    assert cfg["max_num_batched_tokens_limit"] == 400 and cfg["max_num_seqs_limit"] == 8
    sched.set("max_num_batched_tokens", 10)
    sched.set("max_num_batched_tokens", 400)  # the limit follows the start-up value only
    with pytest.raises(ValueError, match=r"in \[1, 400\]"):
        sched.set("max_num_batched_tokens", 401)
    with pytest.raises(ValueError, match=r"\(the start-up value is the limit\)"):
        sched.set("max-num-seqs", 9)
    with pytest.raises(ValueError, match=">= 0"):
        sched.set("long_prefill_token_threshold", -1)
    with pytest.raises(KeyError, match="live settings: max_num_batched_tokens"):
        sched.set("block_size", 4)


def test_names_normalised_in_one_place():
    assert normalize_name(" Max-Num-Seqs ") == "max_num_seqs"


def test_console_and_ctl_read_the_table():
    ints = [s.name for s in LIVE_SETTINGS.values() if s.type is int]
    assert [k.name for k in KNOBS] == ints
    assert all(k.help == LIVE_SETTINGS[k.name].description for k in KNOBS)
    p = argparse.ArgumentParser()
    ctl.add_arguments(p)
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    key = next(a for a in sub.choices["set"]._actions if a.dest == "key")
    assert key.help == ", ".join(s.flag for s in LIVE_SETTINGS.values())
