"""Tool calls streamed as they are generated: ``CallScanner`` on scripted outputs cut into
random pieces, and a choice's stream (``required`` and ``auto`` with each parser) giving the
opening delta before the arguments end, argument fragments that join to the arguments, and
the same calls as the whole response."""

from __future__ import annotations

import json
import random

import pytest

from pagectl.server.chat_output import ChatOutput
from pagectl.server.tools.request import ToolSpec
from pagectl.server.tools.streaming import CallScanner


def pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        k = rng.randint(1, 6)
        out.append(text[i : i + k])
        i += k
    return out


def assemble(deltas: list[dict]) -> list[tuple[str, str]]:
    """OpenAI's client-side assembly of tool-call deltas, checking their order."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls, "one opening delta per call"
            assert d["index"] == len(calls), "indices in order"
            assert d["type"] == "function" and d["function"]["arguments"] == ""
            calls[d["index"]] = {"name": d["function"]["name"], "args": ""}
        else:
            assert d["index"] in calls, "arguments before the call's opening delta"
            calls[d["index"]]["args"] += d["function"]["arguments"]
    return [(c["name"], c["args"]) for c in calls.values()]


REQUIRED = (
    '[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "x": [1, {"a": [2]}]}}, '
    '{"name": "t", "parameters": {}}]'
)


@pytest.mark.parametrize("seed", range(6))
def test_scanner_reads_calls_in_any_pieces(seed):
    sc = CallScanner()
    deltas = [d for p in pieces(REQUIRED, seed) for d in sc.feed(p)]
    assert assemble(deltas) == [
        ("get_weather", '{"city": "Pa\\"ris}", "x": [1, {"a": [2]}]}'),
        ("t", "{}"),
    ]
    assert len(deltas) > 4  # the arguments came in fragments, not at the end


@pytest.mark.parametrize(
    "text, markers, expected",
    [
        (  # hermes: markers skipped, arguments before the name wait for it
            '<tool_call>{"name": "f", "arguments": {"a": "}"}}</tool_call>\n'
            '<tool_call>{"arguments": {"b": 1}, "name": "g"}</tool_call>',
            ("<tool_call>", "</tool_call>"),
            [("f", '{"a": "}"}'), ("g", '{"b": 1}')],
        ),
        (
            '[TOOL_CALLS] [{"name": "a", "arguments": {"y": "z"}}]',
            ("[TOOL_CALLS]",),
            [("a", '{"y": "z"}')],
        ),
        (  # llama3_json: no arguments at all is {}
            '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b"}',
            ("<|python_tag|>",),
            [("a", '{"x": 1}'), ("b", "{}")],
        ),
        ('{"name": "a", "arguments": 5}', (), [("a", "5")]),
        ('{"name": "a", "arguments": "{\\"q\\": 1}"}', (), [("a", '{"q": 1}')]),
        ('{"nom": "a"} [1, 2] "x"', (), []),
    ],
)
def test_scanner_formats(text, markers, expected):
    for seed in range(4):
        sc = CallScanner(markers)
        assert assemble([d for p in pieces(text, seed) for d in sc.feed(p)]) == expected


def test_the_opening_delta_goes_out_once_the_name_is_complete():
    sc = CallScanner()
    assert sc.feed('[{"name": "get_wea') == []
    (opening,) = sc.feed('ther", "parameters": ')
    assert opening["function"]["name"] == "get_weather" and opening["id"].startswith("call_")
    assert sc.feed('{"city": "Ro') == [{"index": 0, "function": {"arguments": '{"city": "Ro'}}]
    assert sc.feed('me"}}]') == [{"index": 0, "function": {"arguments": 'me"}'}}]


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}},
]


def stream_choice(out: ChatOutput, text: str, finish: str, seed: int):
    s = out.stream()
    parts = pieces(text, seed)
    deltas, reason = [], None
    for j, p in enumerate(parts):
        last = j == len(parts) - 1
        ds, r = s.push(p, last, finish if last else None)
        deltas.append(ds)
        reason = r if last else reason
    return deltas, reason


def test_required_streams_each_call_while_it_is_generated():
    out = ChatOutput(ToolSpec(TOOLS, mode="required"), None, None)
    deltas, reason = stream_choice(out, REQUIRED, "stop", 0)
    assert reason == "tool_calls"
    flat = [tc for ds in deltas for d in ds for tc in d.get("tool_calls", [])]
    assert not any("content" in d for ds in deltas for d in ds)
    msg, _ = out.message(REQUIRED, "stop")
    whole = [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]
    ]
    assert [(n, json.loads(a)) for n, a in assemble(flat)] == whole
    # The first call opened well before the end of the output.
    first_open = next(j for j, ds in enumerate(deltas) if any("tool_calls" in d for d in ds))
    assert first_open < len(deltas) // 4
    # Cut short before any name: the text is the content, as in a whole response.
    deltas, reason = stream_choice(out, '[{"na', "length", 1)
    assert reason == "length"
    assert "".join(d.get("content", "") for ds in deltas for d in ds) == '[{"na'


@pytest.mark.parametrize(
    "parser, text, content",
    [
        (
            "hermes",
            'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
            '</tool_call>\n<tool_call>{"name": "t", "arguments": {}}</tool_call>',
            "Let me check. ",
        ),
        ("mistral", 'ok [TOOL_CALLS] [{"name": "t", "arguments": {"y": 1}}]', "ok "),
        ("llama3_json", '{"name": "t", "parameters": {"x": [1, 2]}}', ""),
    ],
)
def test_auto_streams_content_then_calls(parser, text, content):
    out = ChatOutput(ToolSpec(TOOLS, mode="auto"), parser, None)
    for seed in range(3):
        deltas, reason = stream_choice(out, text, "stop", seed)
        assert reason == "tool_calls"
        flat = [d for ds in deltas for d in ds]
        assert "".join(d.get("content", "") for d in flat) == content
        calls = assemble([tc for d in flat for tc in d.get("tool_calls", [])])
        msg, _ = out.message(text, "stop")
        assert [(n, json.loads(a)) for n, a in calls] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["tool_calls"]
        ]


def test_auto_without_a_call_is_all_content():
    out = ChatOutput(ToolSpec(TOOLS, mode="auto"), "hermes", None)
    text = "no call here, not even <tool_"
    deltas, reason = stream_choice(out, text, "stop", 2)
    assert reason == "stop"
    assert "".join(d.get("content", "") for ds in deltas for d in ds) == text
    # A marker followed by no valid call: the held text goes out as content at the end.
    text = "hm <tool_call>not json</tool_call>"
    deltas, reason = stream_choice(out, text, "stop", 3)
    assert reason == "stop"
    assert "".join(d.get("content", "") for ds in deltas for d in ds) == text
