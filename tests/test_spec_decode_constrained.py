"""Speculative decoding of constrained sequences: proposals are cut at the first token the
grammar rejects, each verification row gets the grammar's mask after the proposals before
it, and the matcher ends each step on the sequence's own tokens.

Greedy constrained output with n-gram speculation equals greedy constrained output without
it, token for token (prefix caching on and off, chunked prefill, forced preemption, n > 1),
and every output that ends with ``stop`` validates.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from engine_cases import CHUNK7_BS4, DEFAULT, NO_PREFIX_CACHE, build_tiny_engine, preempt_bs4
from test_spec_decode import NGRAM, check_speculated

from pagectl.engine.sampling_params import SamplingParams
from pagectl.engine.structured_outputs import StructuredOutputsParams

# Arrays of like objects: the output repeats itself, so n-gram lookup finds proposals.
SCHEMA = {
    "type": "object",
    "properties": {
        "rows": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "k": {"enum": ["ab", "cd"]},
                    "v": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["k", "v"],
            },
            "minItems": 3,
            "maxItems": 6,
        }
    },
    "required": ["rows"],
}
REGEX = r"(ab|cd|ef)( (ab|cd|ef)){4,12}\."
PROMPT_TEXT = '{"rows": [{"k": "ab", "v": 1}, {"k": "cd", "v": 2}]} ab cd ef ab cd'


def _engine(path, spec, **kw):
    structured = {"disable_any_whitespace": True}
    return build_tiny_engine(path, spec=spec, structured_outputs_config=structured, **kw)


def _params(seed: int | None, n: int = 1, **so) -> SamplingParams:
    return SamplingParams(
        temperature=0.0 if seed is None else 1.0,
        seed=seed,
        n=n,
        max_tokens=80,
        structured_outputs=StructuredOutputsParams(**so),
    )


def _requests(n: int = 1, seed: int | None = None) -> dict[str, SamplingParams]:
    return {
        "json": _params(seed, n, json=SCHEMA),
        "regex": _params(seed, n, regex=REGEX),
        "choice": _params(seed, n, choice=["ab cd ab cd ab cd", "ab cd ef"]),
        "plain": SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    }


def _run(built, reqs: dict[str, SamplingParams]) -> dict:
    from test_structured_outputs import run

    prompt = built.tokenizer.encode(PROMPT_TEXT)
    return run(built.core, {rid: (prompt, sp) for rid, sp in reqs.items()})


def _check_valid(tok, out: dict) -> None:
    for (rid, _), (ids, reason, err) in out.items():
        assert err is None, err
        text = tok.decode(ids, skip_special_tokens=True)
        if reason != "stop" or rid == "plain":
            continue
        if rid == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif rid == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in ("ab cd ab cd ab cd", "ab cd ef")


@pytest.fixture(scope="module")
def plain_outputs(tiny_qwen3):
    built = _engine(tiny_qwen3, None)
    try:
        return {n: _run(built, _requests(n)) for n in (1, 2)}
    finally:
        built.shutdown()


# A ``_k8`` config proposes 8 tokens, not 4; an ``_n2`` one asks for two samples.
CONFIGS = {
    "default": DEFAULT,
    "no_prefix_cache_k8": NO_PREFIX_CACHE,
    "chunk7_bs4": CHUNK7_BS4,
    # Seven sequences of ~100 tokens in 40 blocks of 4 (plus proposals): preemptions.
    "preempt_bs4_n2": preempt_bs4(40),
}


@pytest.mark.parametrize("config", CONFIGS)
def test_greedy_constrained_speculation_equals_plain(tiny_qwen3, plain_outputs, config):
    spec = dict(NGRAM, num_speculative_tokens=8) if "k8" in config else NGRAM
    n = 2 if config.endswith("n2") else 1
    built = _engine(tiny_qwen3, spec, **CONFIGS[config])
    try:
        out = _run(built, _requests(n))
        expected = plain_outputs[n]
        assert out.keys() == expected.keys()
        for key in expected:
            assert out[key][:2] == expected[key][:2], key
        _check_valid(built.tokenizer, out)
        # Speculation ran on the constrained sequences, with accepted and rejected proposals.
        check_speculated(built, config)
    finally:
        built.shutdown()


def test_sampled_constrained_speculation_validates(tiny_qwen3):
    built = _engine(tiny_qwen3, NGRAM, block_size=8)
    try:
        for seed in range(3):
            out = _run(built, _requests(n=2, seed=seed))
            _check_valid(built.tokenizer, out)
        assert built.core.scheduler.counters.spec_decode_num_accepted_tokens > 0
    finally:
        built.shutdown()


def test_proposals_are_cut_at_the_first_token_the_grammar_rejects(tiny_qwen3):
    import xgrammar as xgr

    built = _engine(tiny_qwen3, None)
    try:
        tok = built.tokenizer
        manager = built.core.structured_outputs
        state = manager.submit(StructuredOutputsParams(regex="ab( ab)*"))
        state.future.result()
        state.activate()
        ab = tok.encode("ab ab ab")
        bad = tok.encode("x")
        assert state.num_valid(ab + bad + ab) == len(ab)
        assert state.num_valid(bad + ab) == 0
        # The matcher did not move: the same tokens are still valid from the start.
        assert state.num_valid(ab) == len(ab)
        # Rows filled ahead match rows filled after really accepting; settle rolls back.
        ahead = xgr.allocate_token_bitmask(len(ab) + 1, manager.vocab_size)
        for j in range(len(ab) + 1):
            state.view_ahead(ab[:j]).fill(ahead, j)
        state.settle()
        assert state.ahead == []
        real = xgr.allocate_token_bitmask(len(ab) + 1, manager.vocab_size)
        state.fill(real, 0)
        for j, t in enumerate(ab, 1):
            assert state.accept(t)
            state.fill(real, j)
        assert ahead.equal(real)
    finally:
        built.shutdown()


def test_draft_model_method_leaves_constrained_sequences_unspeculated(
    tiny_qwen3, plain_outputs, tmp_path
):
    """The draft method's proposals are drawn in the runner, past the grammar cut: its
    constrained sequences decode without speculation, the unconstrained one speculates, and
    every output equals the run without speculation."""
    from pagectl.testing.truncated_draft import write_truncated_draft

    draft = write_truncated_draft(tiny_qwen3, tmp_path / "draft", 1)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    built = _engine(tiny_qwen3, spec, block_size=16)
    try:
        out = _run(built, _requests(1))
        expected = plain_outputs[1]
        for key in expected:
            assert out[key][:2] == expected[key][:2], key
        _check_valid(built.tokenizer, out)
        c = built.core.scheduler.counters
        # Only the plain request's 30 tokens can have come from verifications.
        assert 0 < c.spec_decode_num_drafts <= 30
        assert built.core.scheduler.kv.pool.num_used_blocks == 0
    finally:
        built.shutdown()
