"""Structural tags: both request shapes (vLLM's ``structures``/``triggers`` and xgrammar's
``format``) normalised to xgrammar's, the request surface (``response_format``,
``structured_outputs.structural_tag``), and the engine's outputs on a random-weight tiny model:
the JSON inside every complete tag validates against its schema."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagectl.engine.sampling_params import SamplingParams
from pagectl.engine.structured_outputs import StructuredOutputsError, StructuredOutputsParams
from pagectl.engine.structured_outputs.params import build_grammar
from pagectl.engine.structured_outputs.structural_tag import normalize
from pagectl.server.errors import APIError
from pagectl.server.structured import check_grammar, parse_structured

ADD = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "c": {"enum": ["a", "b"]}},
    "required": ["x", "c"],
}
OK = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
# vLLM's shape: free text; "=" must go on as "=f>", JSON for ADD, then "</f>".
VLLM_TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "=f>", "schema": ADD, "end": "</f>"}],
    "triggers": ["="],
}
# xgrammar's shape: only tags, one a line, at least one.
XGR_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tags_with_separator",
        "separator": "\n",
        "at_least_one": True,
        "tags": [
            {
                "type": "tag",
                "begin": "<add>",
                "content": {"type": "json_schema", "json_schema": ADD},
                "end": "</add>",
            },
            {
                "type": "tag",
                "begin": "<ok>",
                "content": {"type": "json_schema", "json_schema": OK},
                "end": "</ok>",
            },
        ],
    },
}


def test_vllm_shape_becomes_triggered_tags():
    tag = json.loads(normalize(VLLM_TAG, disable_any_whitespace=False))
    assert tag == {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["="],
            "tags": [
                {
                    "type": "tag",
                    "begin": "=f>",
                    "content": {"type": "json_schema", "json_schema": ADD},
                    "end": "</f>",
                }
            ],
        },
    }
    # "type" may be left out, and the value may come as JSON text.
    no_type = {k: v for k, v in VLLM_TAG.items() if k != "type"}
    assert normalize(json.dumps(no_type), False) == normalize(VLLM_TAG, False)


def test_whitespace_bound_only_when_any_whitespace_is_disabled():
    assert "max_whitespace_cnt" not in normalize(XGR_TAG, disable_any_whitespace=False)
    compact = json.loads(normalize(XGR_TAG, disable_any_whitespace=True))
    contents = [t["content"] for t in compact["format"]["tags"]]
    assert [c["max_whitespace_cnt"] for c in contents] == [1, 1]
    # A region's own bound is kept; a schema keyword named like a format is not touched.
    own = json.loads(json.dumps(XGR_TAG))
    own["format"]["tags"][0]["content"]["max_whitespace_cnt"] = 4
    own["format"]["tags"][1]["content"]["json_schema"] = {
        "type": "object",
        "properties": {"type": {"const": "json_schema"}, "json_schema": {"type": "string"}},
    }
    out = json.loads(normalize(own, True))["format"]["tags"]
    assert out[0]["content"]["max_whitespace_cnt"] == 4
    assert "max_whitespace_cnt" not in json.dumps(out[1]["content"]["json_schema"])


@pytest.mark.parametrize(
    "bad, message",
    [
        ([1], "must be an object"),
        ({"type": "json_schema"}, "structural_tag.type must be"),
        ({"triggers": ["<"]}, "structures must be a non-empty list"),
        ({"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": []}, "triggers must be"),
        (
            {"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["["]},
            "none of the triggers",
        ),
        ({"structures": [{"begin": "<a>", "end": 3}], "triggers": ["<"]}, "needs string"),
        ({"type": "structural_tag"}, "needs `structures`"),
        ("{", "not valid JSON"),
        # Keys neither form takes are refused, not ignored.
        ({"format": {"type": "const_string", "value": "a"}, "extra": 1}, 'take "extra"'),
        (
            {"structures": [{"begin": "<a>", "end": "</a>", "x": 1}], "triggers": ["<"]},
            'structures[0] does not take "x"',
        ),
        (
            {"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<"], "format": {}},
            'does not take "format"',
        ),
    ],
)
def test_bad_tags_name_the_problem(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        normalize(bad, False)


def test_bad_tag_inside_is_the_backend_message():
    bad = json.loads(json.dumps(XGR_TAG))
    bad["format"]["tags"][0]["content"]["json_schema"] = {"type": "object", "properties": 3}
    with pytest.raises(StructuredOutputsError, match="properties must be an object"):
        build_grammar(StructuredOutputsParams(structural_tag=bad), False)
    with pytest.raises(StructuredOutputsError, match="Format type not recognized"):
        build_grammar(StructuredOutputsParams(structural_tag={"format": {"type": "nope"}}), False)


def test_a_tag_nested_too_deep_is_refused_not_a_crash():
    inner: list = []
    deepest = inner
    for _ in range(5000):  # deeper than json's encoder goes
        deepest.append([])
        deepest = deepest[0]
    tag = {"type": "structural_tag", "format": {"type": "x", "a": inner}}
    with pytest.raises(StructuredOutputsError, match="nested too deep"):
        StructuredOutputsParams(structural_tag=tag)
    for field, body in (
        ("structural_tag", {"structural_tag": tag}),
        ("response_format", {"response_format": tag}),
        ("structured_outputs", {"structured_outputs": {"structural_tag": tag}}),
    ):
        with pytest.raises(APIError) as e:
            parse_structured(body)
        assert e.value.status == 400 and e.value.param == field, e.value.message
        assert "nested too deep" in e.value.message


def test_request_surface():
    c = parse_structured({"response_format": VLLM_TAG})
    assert c is not None and c.param == "response_format"
    assert c.params.kind == "structural_tag"
    assert json.loads(c.params.structural_tag or "") == VLLM_TAG
    check_grammar(c)
    so = parse_structured({"structured_outputs": {"structural_tag": json.dumps(XGR_TAG)}})
    assert so is not None and so.params.kind == "structural_tag"
    check_grammar(so)
    top = parse_structured({"structural_tag": json.dumps(XGR_TAG)})
    assert top is not None and top.param == "structural_tag"
    assert top.params.cache_key(True) == so.params.cache_key(True)
    with pytest.raises(APIError) as e:
        parse_structured({"structured_outputs": {"structural_tag": "{"}})
    assert e.value.param == "structured_outputs" and "not valid JSON" in e.value.message
    bad = parse_structured(
        {"response_format": {"type": "structural_tag", "structures": [], "triggers": ["<"]}}
    )
    assert bad is not None
    with pytest.raises(APIError) as e:
        check_grammar(bad)
    assert e.value.status == 400 and e.value.param == "response_format"
    assert "structures must be a non-empty list" in e.value.message
    # A tag naming a token can only be checked with the vocabulary: the engine does it.
    token_tag = {
        "format": {
            "type": "tag",
            "begin": {"type": "token", "token": "<|im_start|>"},
            "content": {"type": "json_schema", "json_schema": OK},
            "end": "<|im_end|>",
        }
    }
    check_grammar(parse_structured({"structured_outputs": {"structural_tag": token_tag}}))


# -- the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tiny_qwen3):
    from test_structured_outputs import _build

    b = _build(tiny_qwen3)
    yield b
    b.shutdown()


def _run(built, tag, n: int, seed: int, max_tokens: int = 100) -> list[tuple[str, str | None]]:
    from test_structured_outputs import run

    tok = built.tokenizer
    sp = SamplingParams(
        temperature=1.0,
        seed=seed,
        n=n,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(structural_tag=tag),
    )
    out = run(built.core, {"r": (tok.encode("Hello"), sp)})
    assert all(err is None for _, _, err in out.values())
    return [(tok.decode(ids, skip_special_tokens=True), r) for ids, r, _ in out.values()]


def test_xgrammar_shape_every_tag_validates(built):
    outs = _run(built, XGR_TAG, n=6, seed=1)
    stopped = 0
    for text, reason in outs:
        tags = re.findall(r"<(add|ok)>(.*?)</\1>", text, re.S)
        if reason == "stop":
            stopped += 1
            # Nothing but tags, one a line.
            assert "\n".join(f"<{k}>{v}</{k}>" for k, v in tags) == text
        assert tags
        for kind, body in tags:
            jsonschema.validate(json.loads(body), ADD if kind == "add" else OK)
    assert stopped >= 3


def test_vllm_shape_free_text_with_valid_tags(built):
    # Free text around the tags: the random model writes "=" now and then, and from there
    # the grammar holds it to "=f>" + JSON + "</f>".
    outs = _run(built, VLLM_TAG, n=8, seed=3)
    found = 0
    for text, reason in outs:
        for body in re.findall(r"=f>(.*?)</f>", text, re.S):
            jsonschema.validate(json.loads(body), ADD)
            found += 1
        # Every "=" opens a tag (the last one may be cut by the length limit).
        unopened = text.count("=") - text.count("=f>")
        assert unopened == 0 or (unopened == 1 and reason == "length")
    assert found >= 3
