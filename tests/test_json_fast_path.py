"""Big bodies are decoded by msgspec first; the result and every refusal match ``json``'s."""

from __future__ import annotations

import json

import pytest

from pagectl.server import json_fields
from pagectl.server.errors import APIError
from pagectl.server.json_fields import FAST_PARSE_BYTES, parse_json

PAD = "x" * FAST_PARSE_BYTES  # makes any body below take the fast path


def _big(fragment: str) -> bytes:
    return ('{"pad": "' + PAD + '", ' + fragment + "}").encode()


def _refusal(raw: bytes) -> str:
    with pytest.raises(APIError) as ei:
        parse_json(raw)
    assert ei.value.status == 400
    return ei.value.message


@pytest.mark.parametrize(
    "fragment",
    [
        '"prompt": "caf\\u00e9 \\n", "n": 2, "t": 0.7, "big": 123456789012345678901234567890',
        '"a": [1, 2.5e-324, -0.0, 1E5, true, null, {"b": []}], "a": "last wins"',
        '"stop": ["\\ud83d\\ude00"]',
    ],
)
def test_a_big_body_decodes_to_what_json_gives(fragment):
    raw = _big(fragment)
    assert len(raw) >= FAST_PARSE_BYTES
    assert parse_json(raw) == json.loads(raw)


@pytest.mark.parametrize(
    "fragment",
    [
        '"temperature": NaN',
        '"temperature": Infinity',
        '"top_p": 1e999',
        '"prompt": "hi",',
        '"stop": "\t"',
    ],
)
def test_a_big_body_is_refused_as_a_small_one_is(fragment, monkeypatch):
    fast = _refusal(_big(fragment))
    monkeypatch.setattr(json_fields, "FAST_PARSE_BYTES", 10**12)  # force the json path
    assert fast == _refusal(_big(fragment))


def test_a_big_array_is_still_not_an_object():
    raw = ("[" + ",".join(["1"] * FAST_PARSE_BYTES) + "]").encode()
    assert "JSON object" in _refusal(raw)


def test_the_fast_path_is_taken(monkeypatch):
    calls = []
    real = json_fields._fast_decode
    monkeypatch.setattr(json_fields, "_fast_decode", lambda raw: calls.append(1) or real(raw))
    parse_json(_big('"n": 1'))
    parse_json(b'{"n": 1}')
    assert calls == [1]


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 10**30])
def test_a_long_integer_in_a_big_body_is_still_found(value):
    from pagectl.server.field_checks import check_body

    raw = _big(f'"priority": {value}')
    with pytest.raises(APIError) as ei:
        check_body(parse_json(raw), raw)
    assert ei.value.status == 400 and ei.value.param == "priority"
    ok = _big(f'"priority": {2**63 - 1}, "n": -{2**63}')
    check_body(parse_json(ok), ok)  # the int64 bounds themselves pass
