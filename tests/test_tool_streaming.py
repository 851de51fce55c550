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


def pieces(text: str, seed: int, shortest: int = 1, longest: int = 6) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        k = rng.randint(shortest, longest)
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


# -- any split gives the deltas that split dictates; the held text stays bounded ------------


class Script:
    """A scripted output of tool calls, with where each call's name ends and how its
    arguments go out: ``("stream", start, end)`` (an object or array, sent as it grows) or
    ``("whole", at, value)`` (a string, number or missing arguments: sent once ``at`` is
    scanned)."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[tuple[str, int, tuple]] = []

    def add(self, text: str) -> Script:
        self.text += text
        return self

    def call(self, name: str, args: str | None, *, args_first: bool = False) -> Script:
        """A call object; ``args`` is the arguments' JSON text (None: no arguments)."""
        name_member = f'"name": {json.dumps(name)}'
        members = [name_member] if args is None else [name_member, '"arguments": ']
        if args_first:
            members.reverse()
        at = len(self.text) + 1
        spans = {}
        for j, m in enumerate(members):
            if j:
                at += 2  # ", "
            spans[m] = at
            at += len(m)
            if m == '"arguments": ':
                spans["args"] = at
                at += len(args or "")
        name_end = spans[name_member] + len(name_member)
        close = at  # the call's closing brace
        self.text += "{" + ", ".join(m + (args if m.startswith('"arg') else "") for m in members)
        self.text += "}"
        assert self.text[close] == "}"
        if args is None:
            how: tuple = ("whole", close, "{}")
        elif args[0] in "{[":
            how = ("stream", spans["args"], spans["args"] + len(args))
        else:  # a string or a scalar: sent when it ends (its quote, or the next , or })
            end = spans["args"] + len(args)
            value = json.loads(args)
            how = ("whole", end - 1 if args[0] == '"' else end, value if args[0] == '"' else args)
        self.calls.append((name, name_end, how))
        return self


def expected_deltas(script: Script, parts: list[str]) -> list[list[tuple]]:
    """Per feed: ("open", index, name) and ("args", index, fragment) in order."""
    out, before = [], 0
    for p in parts:
        end = before + len(p)
        feed: list[tuple] = []
        for k, (name, name_end, how) in enumerate(script.calls):
            if name_end > end:
                continue  # (its name is not complete: nothing for it yet)
            opened_now = name_end > before
            if opened_now:
                feed.append(("open", k, name))
            if how[0] == "stream":
                lo, hi = how[1] if opened_now else max(how[1], before), min(how[2], end)
                if hi > lo:
                    feed.append(("args", k, script.text[lo:hi]))
            elif how[1] < end and (opened_now or how[1] >= before):
                feed.append(("args", k, how[2]))
        out.append(feed)
        before = end
    return out


def scripts() -> dict[str, tuple[Script, tuple[str, ...]]]:
    nested = (
        '{"code": "if (x) { return \\"}\\"; } // ]", "path": "a\\\\b{", '
        '"opts": {"deep": [1, {"k": [true, null, "}]"]}], "empty": {}}}'
    )
    hermes = ("<tool_call>", "</tool_call>")
    return {
        "hermes": (
            Script()
            .add("<tool_call>\n")
            .call("get_weather", '{"city": "Pa\\"ris", "unit": "C"}')
            .add("\n</tool_call>\n<tool_call>\n")
            .call("run", nested, args_first=True)
            .add("\n</tool_call>\n<tool_call>")
            .call("noop", None)
            .add("</tool_call><tool_call>")
            .call("search", '["a", {"q": "x]}"}]')
            .add("</tool_call>"),
            hermes,
        ),
        "mistral": (
            Script()
            .add("[TOOL_CALLS] [")
            .call("f", nested)
            .add(", ")
            .call("g", '"{\\"q\\": 1, \\"r\\": \\"}\\"}"')
            .add(", ")
            .call("h", "-12.5e3", args_first=True)
            .add("]"),
            ("[TOOL_CALLS]",),
        ),
        "llama3_json": (
            Script()
            .add("<|python_tag|>")
            .call("a", '{"x": [1, 2], "s": "\\u00e9\\n"}')
            .add("; ")
            .call("b", "true")
            .add("; ")
            .call("c", "{}"),
            ("<|python_tag|>",),
        ),
    }


def splits(text: str, seed: int) -> list[str]:
    """The whole text, one character at a time, or random pieces (some empty)."""
    if seed == 0:
        return [text]
    if seed == 1:
        return list(text)
    return pieces(text, seed, 0, 12)


@pytest.mark.parametrize("name", ["hermes", "mistral", "llama3_json"])
@pytest.mark.parametrize("seed", range(8))
def test_scanner_deltas_are_the_ones_each_split_dictates(name, seed):
    script, markers = scripts()[name]
    parts = splits(script.text, seed)
    sc = CallScanner(markers)
    got = []
    for p in parts:
        feed = []
        for d in sc.feed(p):
            if "id" in d:
                assert d["id"] == sc.calls[d["index"]].id
                assert d["type"] == "function" and d["function"]["arguments"] == ""
                feed.append(("open", d["index"], d["function"]["name"]))
            else:
                assert set(d) == {"index", "function"}
                feed.append(("args", d["index"], d["function"]["arguments"]))
        got.append(feed)
    assert got == expected_deltas(script, parts)
    # The fragments join to each call's arguments, as ``calls`` holds them.
    joined = [
        "".join(f for feed in got for kind, k, f in feed if kind == "args" and k == i)
        for i in range(len(script.calls))
    ]
    assert [(c.name, c.arguments) for c in sc.calls] == [
        (n, a) for (n, _, _), a in zip(script.calls, joined, strict=True)
    ]


def test_scanner_holds_a_bounded_text_over_many_calls():
    one = (
        Script()
        .add("<tool_call>\n")
        .call("write", '{"path": "a/b.txt", "text": "x{y}\\"z", "n": [1, 2]}')
        .add("\n</tool_call>\n")
        .text
    )
    sc = CallScanner(("<tool_call>", "</tool_call>"))
    most = 0
    for _ in range(2000):
        for ch in one:
            sc.feed(ch)
        most = max(most, sc.retained_chars)
    assert len(sc.calls) == 2000
    assert sc.calls[-1].arguments == '{"path": "a/b.txt", "text": "x{y}\\"z", "n": [1, 2]}'
    assert most < len(one)  # what one call needs, not what was generated


def test_scanner_lets_go_of_a_long_argument_string_as_it_is_sent():
    sc = CallScanner()
    sc.feed('{"name": "w", "arguments": {"text": "')
    for _ in range(5000):
        for ch in "key: value, ":
            sc.feed(ch)
    assert sc.retained_chars < 20
    sc.feed('"}}')
    assert sc.calls[0].arguments == '{"text": "' + "key: value, " * 5000 + '"}'
