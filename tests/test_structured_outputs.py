"""Structured outputs in the engine (xgrammar): outputs of a random-weight tiny model that end
with ``stop`` validate against their schema, with n > 1, preemption, chunked prefill and the
prefix cache; constrained rows leave unconstrained ones untouched; compiles run off the step
and are cached; a compile failure fails only its request."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagectl.engine.args import EngineArgs, parse_structured_outputs_config
from pagectl.engine.builder import build_engine
from pagectl.engine.sampling_params import SamplingParams
from pagectl.engine.structured_outputs import StructuredOutputsError, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ada", "bob", "cy"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {
            "type": "array",
            "items": {"enum": ["x", "y", "z"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "integer", "minimum": 10, "maximum": 99}},
            "required": ["zip"],
        },
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "ok"],
}


def _build(model_dir, **kw):
    args = dict(
        model=str(model_dir),
        dtype="float32",
        num_kv_blocks=128,
        block_size=8,
        structured_outputs_config={"disable_any_whitespace": True},
    )
    args.update(kw)
    return build_engine(EngineArgs(**args))


@pytest.fixture(scope="module")
def built(tiny_qwen3):
    b = _build(tiny_qwen3)
    yield b
    b.shutdown()


def run(core, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Run requests together; {(id, index): (token ids, finish_reason, error)}."""
    for rid, (prompt, sp) in requests.items():
        core.add_request(rid, prompt, sp)
    out: dict[tuple[str, int], list] = {}
    while core.has_unfinished():
        for o in core.step():
            entry = out.setdefault((o.request_id, o.index), [[], None, None])
            entry[0] += o.new_token_ids
            entry[1] = o.finish_reason or entry[1]
            entry[2] = o.error or entry[2]
    return out


def constrained(seed: int, n: int = 1, max_tokens: int = 96, **so) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        n=n,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**(so or {"json": SCHEMA})),
    )


def check_json(tok, out: dict, schema: dict) -> int:
    """Every stop-finished output parses and validates; returns how many stopped."""
    stopped = 0
    for ids, reason, err in out.values():
        assert err is None
        if reason == "stop":
            jsonschema.validate(json.loads(tok.decode(ids, skip_special_tokens=True)), schema)
            stopped += 1
    return stopped


def test_json_schema_outputs_validate_with_n_greater_than_one(built):
    tok = built.tokenizer
    prompt = tok.encode("Hello world! The quick brown fox")
    out = run(built.core, {f"r{i}": (prompt, constrained(i, n=3)) for i in range(4)})
    assert len(out) == 12
    assert check_json(tok, out, SCHEMA) == 12  # bounded schema: every output completes


def test_unconstrained_rows_get_the_same_greedy_tokens(built):
    tok = built.tokenizer
    prompts = [tok.encode(t) for t in ("def add(a, b):", "import os\n", "for i in range(10):")]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = run(built.core, {f"a{i}": (p, greedy) for i, p in enumerate(prompts)})
    mixed_reqs = {f"m{i}": (p, greedy) for i, p in enumerate(prompts)}
    mixed_reqs.update({f"c{i}": (p, constrained(i)) for i, p in enumerate(prompts)})
    mixed = run(built.core, mixed_reqs)
    for i in range(len(prompts)):
        assert mixed[(f"m{i}", 0)][0] == alone[(f"a{i}", 0)][0]
    assert check_json(tok, {k: v for k, v in mixed.items() if k[0][0] == "c"}, SCHEMA) == 3


def test_preemption_chunked_prefill_and_prefix_cache_keep_matchers_right(tiny_qwen3):
    # 16 blocks of 8 tokens for 6 sequences of ~100 tokens: preemptions are certain.
    b = _build(tiny_qwen3, num_kv_blocks=16, long_prefill_token_threshold=8)
    try:
        tok = b.tokenizer
        prompt = tok.encode("A request is admitted when the scheduler finds free blocks")
        reqs = {f"p{i}": (prompt, constrained(i, n=2, max_tokens=90)) for i in range(3)}
        out = run(b.core, reqs)
        assert b.core.scheduler.counters.preemptions > 0
        assert check_json(tok, out, SCHEMA) == 6
        again = run(b.core, {"q": (prompt, constrained(7, max_tokens=90))})
        assert b.core.scheduler.counters.prefix_hits > 0
        assert check_json(tok, again, SCHEMA) == 1
        assert b.core.scheduler.kv.pool.num_used_blocks == 0
    finally:
        b.shutdown()


def test_regex_choice_grammar_and_max_tokens(built):
    tok = built.tokenizer
    prompt = tok.encode("Hello")
    out = run(
        built.core,
        {
            "re": (prompt, constrained(1, n=4, regex=r"[a-c]{2,4}-[0-9]{2}")),
            "ch": (prompt, constrained(2, n=4, choice=["yes", "no", "maybe so"])),
            "gr": (prompt, constrained(3, n=4, grammar='root ::= "(" [0-9] ("+" [0-9])* ")"')),
            "cut": (prompt, constrained(4, max_tokens=3)),
        },
    )
    texts = {k: tok.decode(v[0], skip_special_tokens=True) for k, v in out.items()}
    for i in range(4):
        assert out[("re", i)][1] == "stop" and re.fullmatch(
            r"[a-c]{2,4}-[0-9]{2}", texts[("re", i)]
        )
        assert texts[("ch", i)] in ("yes", "no", "maybe so")
        if out[("gr", i)][1] == "stop":
            assert re.fullmatch(r"\([0-9](\+[0-9])*\)", texts[("gr", i)])
    assert out[("cut", 0)][1] == "length" and len(out[("cut", 0)][0]) == 3


def test_compiles_are_cached_and_counted(built):
    c = built.core.scheduler.counters
    before = (c.grammar_compiles, c.grammar_cache_hits)
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
    tok = built.tokenizer
    prompt = tok.encode("Hi")
    run(built.core, {"a": (prompt, constrained(0, json=schema))})
    run(built.core, {"b": (prompt, constrained(1, json=dict(reversed(list(schema.items())))))})
    assert c.grammar_compiles == before[0] + 1  # same schema, keys in another order: cached
    assert c.grammar_cache_hits == before[1] + 1
    assert c.grammar_compile_seconds > 0


def test_a_failed_compile_fails_only_its_request(built, monkeypatch):
    tok = built.tokenizer
    prompt = tok.encode("Hi")
    mgr = built.core.structured_outputs

    def broken(*a):
        raise StructuredOutputsError("structured_outputs", "boom")

    monkeypatch.setattr(mgr, "_compile", broken)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = run(built.core, {"bad": (prompt, constrained(0, regex="z+")), "good": (prompt, greedy)})
    assert out[("bad", 0)][1] == "error" and "boom" in out[("bad", 0)][2]
    assert out[("good", 0)][1] == "length" and len(out[("good", 0)][0]) == 4
    assert not built.core.scheduler.groups


def test_abort_while_compiling_leaves_nothing_behind(built):
    tok = built.tokenizer
    built.core.add_request("x", tok.encode("Hi"), constrained(9, regex="q{1,40}w"))
    assert built.core.scheduler.compiling
    assert built.core.abort_request("x")
    assert not built.core.scheduler.compiling and not built.core.scheduler.groups
    built.core.step()


def test_params_and_config_checks():
    with pytest.raises(StructuredOutputsError, match="exactly one"):
        StructuredOutputsParams(json="{}", regex="a")
    with pytest.raises(StructuredOutputsError, match="choice"):
        StructuredOutputsParams(choice=[])
    sp = SamplingParams(structured_outputs={"regex": "a+"})  # as it crosses the wire
    assert sp.structured_outputs == StructuredOutputsParams(regex="a+")
    assert parse_structured_outputs_config('{"disable_any_whitespace": true}') == {
        "backend": "auto",
        "disable_any_whitespace": True,
    }
    with pytest.raises(ValueError, match="not supported"):
        parse_structured_outputs_config({"backend": "xgrammar", "reasoning_parser": "x"})
    with pytest.raises(ValueError, match="backend"):
        parse_structured_outputs_config({"backend": "outlines"})


def test_offline_llm_takes_the_same_field(tiny_qwen3):
    from pagectl import LLM, StructuredOutputsParams

    llm = LLM(str(tiny_qwen3), dtype="float32", num_kv_blocks=64, block_size=8)
    try:
        sp = SamplingParams(
            temperature=1.0,
            seed=0,
            n=2,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]),
        )
        (out,) = llm.generate(["Hello"], sp)
        assert [c.text for c in out.outputs] and all(
            c.text in ("alpha", "beta") for c in out.outputs
        )
    finally:
        llm.shutdown()
