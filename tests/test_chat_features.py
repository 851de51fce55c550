"""Tool-call parsers on scripted text, the reasoning split (whole and streamed), the sandboxed
chat template's limits, and the field checks."""

from __future__ import annotations

import json
import time

import pytest

from pagectl.server import chat_template, reasoning
from pagectl.server.chat import ChatSettings, render_messages
from pagectl.server.chat_output import ChatOutput
from pagectl.server.errors import APIError
from pagectl.server.fields import CHAT_FIELDS, check_fields
from pagectl.server.tools.parsers import PARSERS, get_parser
from pagectl.server.tools.request import parse_tools

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_hermes_parser_finds_calls_and_keeps_content():
    p = get_parser("hermes")
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call>'
    )
    content, calls = p.extract(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"}),
        ("get_time", {"zone": 1}),
    ]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    # Not a call: stays content; an unterminated call at the end still parses.
    assert p.extract("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>",
        [],
    )
    _, calls = p.extract('<tool_call>{"name": "f", "arguments": {}}')
    assert [c.name for c in calls] == ["f"]
    # Streaming hold-back: nothing from a (possible) marker on.
    assert p.safe_prefix("hello <tool") == len("hello ")
    assert p.safe_prefix("hello <tool_call>{") == len("hello ")
    assert p.safe_prefix("hello") == 5


def test_llama3_json_and_mistral_parsers():
    content, calls = get_parser("llama3_json").extract(
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    )
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("a", '{"x": 1}'),
        ("b", "{}"),
    ]
    assert get_parser("llama3_json").extract("plain answer") == ("plain answer", [])
    content, calls = get_parser("mistral").extract(
        'ok [TOOL_CALLS] [{"name": "a", "arguments": {"y": "z"}}]'
    )
    assert content == "ok" and calls[0].name == "a" and json.loads(calls[0].arguments) == {"y": "z"}
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="known"):
        get_parser("nope")


@pytest.mark.parametrize("parser", reasoning.PARSERS)
@pytest.mark.parametrize(
    "text",
    [
        "<think>a b</think>answer",
        "\n<think>x</think>",
        "no tags here",
        "r1 style</think>ans",
        "<thi",
    ],
)
def test_reasoning_stream_matches_the_whole_split(parser, text):
    whole = reasoning.split(parser, text)
    for step in (1, 2, 3, 7):
        s = reasoning.ReasoningStream(parser)
        r = c = ""
        for i in range(0, len(text), step):
            dr, dc = s.push(text[i : i + step])
            r, c = r + dr, c + dc
        dr, dc = s.push("", final=True)
        r, c = r + dr, c + dc
        assert ((r or None), (c or None)) == whole, (step, r, c)


def test_reasoning_split_by_parser():
    assert reasoning.split("qwen3", "<think>plan</think>done") == ("plan", "done")
    assert reasoning.split("qwen3", "plan</think>done") == (None, "plan</think>done")
    assert reasoning.split("deepseek_r1", "plan</think>done") == ("plan", "done")
    assert reasoning.split("deepseek_r1", "still thinking") == ("still thinking", None)
    msg, reason = ChatOutput(None, None, "qwen3").message("<think>hm</think>hi", "stop")
    assert msg == {"role": "assistant", "content": "hi", "reasoning_content": "hm"}
    assert reason == "stop"


def test_sandbox_stops_runaway_templates():
    t0 = time.monotonic()
    with pytest.raises(chat_template.TemplateError, match="longer than"):
        chat_template.render(
            "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}", {}
        )
    assert time.monotonic() - t0 < chat_template.TIME_LIMIT_S + 1.5
    with pytest.raises(chat_template.TemplateError, match="more than"):
        chat_template.render("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", {})
    with pytest.raises(chat_template.TemplateError, match="too large"):
        chat_template.render("{{ 'x' * 100000000 }}", {})
    with pytest.raises(chat_template.TemplateError):  # the sandbox: no dunder attributes
        chat_template.render("{{ ''.__class__.__mro__ }}", {})
    with pytest.raises(chat_template.TemplateError, match="boom"):
        chat_template.render("{{ raise_exception('boom') }}", {})
    assert chat_template.render("{{ x | tojson }}", {"x": {"é": 1}}) == '{"é": 1}'


class _Tok:
    special_tokens_map = {"eos_token": "<e>"}
    chat_template = (
        "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{{ eos_token }}"
    )

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) for ch in text]


def test_render_options_and_trust():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "par"}]
    ids, text = render_messages(msgs, _Tok(), {"continue_final_message": True}, ChatSettings())
    assert text == "[user:hi][assistant:par"
    own = {"chat_template": "{{ messages[0].content }}!"}
    with pytest.raises(APIError, match="trust-request-chat-template"):
        render_messages(msgs, _Tok(), own, ChatSettings())
    _, text = render_messages(msgs, _Tok(), own, ChatSettings(trust_request_chat_template=True))
    assert text == "hi!"
    _, text = render_messages(
        msgs[:1], _Tok(), {"chat_template_kwargs": {"x": 1}}, ChatSettings(chat_template="{{ x }}")
    )
    assert text == "1"
    with pytest.raises(APIError, match="set by the server"):
        render_messages(msgs, _Tok(), {"chat_template_kwargs": {"messages": []}}, ChatSettings())


def test_tool_choice_rules():
    assert parse_tools({"tools": [TOOL], "tool_choice": "none"}, False).mode == "none"
    with pytest.raises(APIError, match="enable-auto-tool-choice"):
        parse_tools({"tools": [TOOL]}, False)
    assert parse_tools({"tools": [TOOL]}, True).mode == "auto"
    spec = parse_tools(
        {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}, False
    )
    schema = json.loads(spec.constraint().json)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    with pytest.raises(APIError, match="needs tools"):
        parse_tools({"tool_choice": "required"}, False)
    with pytest.raises(APIError, match="not supported by pagectl"):
        parse_tools({"functions": [{}]}, False)


def test_documented_fields_refused_unknown_ignored():
    check_fields({"use_beam_search": False, "length_penalty": 1.0, "whatever": 3}, CHAT_FIELDS, "t")
    for body in ({"use_beam_search": True}, {"length_penalty": 0.5}, {"logits_processors": ["x"]}):
        with pytest.raises(APIError) as e:
            check_fields(body, CHAT_FIELDS, "t")
        assert e.value.param == next(iter(body)) and "not supported by pagectl" in e.value.message
    with pytest.raises(APIError):  # True is not the no-op 1 of length_penalty
        check_fields({"length_penalty": True}, CHAT_FIELDS, "t")


def test_concurrent_renders_keep_their_own_time_limit():
    from concurrent.futures import ThreadPoolExecutor

    loop = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(chat_template.render, loop, {})
        for _ in range(20):  # quick renders finishing meanwhile must not lift its limit
            assert pool.submit(chat_template.render, "{{ 1 }}", {}).result() == "1"
        with pytest.raises(chat_template.TemplateError, match="longer than"):
            slow.result(timeout=chat_template.TIME_LIMIT_S + 5)
