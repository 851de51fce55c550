"""EngineArgs: the flags generated from its fields, one validation, the typed crossing."""

from __future__ import annotations

import argparse
import dataclasses

import msgspec
import pytest

from pagectl.engine.args import EngineArgs, add_cli_arguments


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="x")
    add_cli_arguments(p)
    return p


def test_every_field_has_a_flag_with_the_fields_default():
    p = _parser()
    by_dest = {a.dest: a for a in p._actions}
    for f in dataclasses.fields(EngineArgs):
        action = by_dest[f.name]
        assert "--" + f.name.replace("_", "-") in action.option_strings
        assert action.default == f.default
        assert action.help
    ns = p.parse_args([])
    assert EngineArgs.from_cli(ns) == EngineArgs()


def test_booleans_have_a_no_flag_and_aliases_stay():
    ns = _parser().parse_args(["--no-enable-prefix-caching", "--enforce-eager", "--tp", "2"])
    args = EngineArgs.from_cli(ns)
    assert args.enable_prefix_caching is False and args.enforce_eager is True
    assert args.tensor_parallel_size == 2
    args = EngineArgs.from_cli(_parser().parse_args(["--tensor-parallel-size", "3"]))
    assert args.tensor_parallel_size == 3


def test_choices_and_exclusive_pool_size_flags():
    p = _parser()
    with pytest.raises(SystemExit):
        p.parse_args(["--dtype", "int3"])
    with pytest.raises(SystemExit):
        p.parse_args(["--num-kv-blocks", "8", "--kv-cache-memory", "1GiB"])
    with pytest.raises(SystemExit):
        p.parse_args(["--num-kv-blocks", "8", "--gpu-memory-utilization", "0.9"])
    ns = p.parse_args(["--kv-cache-memory", "1GiB", "--scheduling-policy", "priority"])
    args = EngineArgs.from_cli(ns, model="m")
    assert (args.kv_cache_memory, args.scheduling_policy, args.model) == ("1GiB", "priority", "m")


def test_token_budget_default_is_resolved_in_one_place():
    assert EngineArgs().token_budget("cpu") == 2048
    assert EngineArgs().token_budget("cuda") == 8192
    assert EngineArgs(max_num_batched_tokens=96).token_budget("cuda") == 96


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
        (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
        (dict(block_size=2048), r"block_size must be in \[1, 1024\]"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold must be >= 0"),
        (dict(scheduling_policy="lifo"), "scheduling_policy must be one of fcfs, priority"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
        (dict(kv_cache_memory="lots"), "not a size"),
        (dict(max_num_seqs=True), "max_num_seqs must be an integer"),
    ],
)
def test_validated_once_at_construction(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kw)


def test_crosses_to_another_process_as_the_typed_struct():
    args = EngineArgs(model="m", kv_cache_memory="2GiB", max_num_batched_tokens=64, seed=3)
    wire = msgspec.json.encode(args)
    assert msgspec.json.decode(wire, type=EngineArgs) == args
    bad = wire.replace(b'"max_num_batched_tokens":64', b'"max_num_batched_tokens":0')
    with pytest.raises(msgspec.ValidationError, match="max_num_batched_tokens"):
        msgspec.json.decode(bad, type=EngineArgs)
