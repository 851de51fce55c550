"""End to end: structured outputs and tool calling through a real ``pagectl daemon`` on the
tiny Qwen3 checkpoint, driven with the official openai SDK (one daemon for the module)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "stops": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["n"],
            },
            "minItems": 2,
            "maxItems": 3,
        },
        "flags": {
            "type": "object",
            "properties": {"pet": {"type": "boolean"}},
            "required": ["pet"],
        },
    },
    "required": ["city", "days", "stops", "flags"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "Plan a trip"}]
KEY = "sk-test"
# A daemon --chat-template that shows tools, assistant tool calls and tool results.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def daemon(structured_daemon):
    return structured_daemon(
        [
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--api-key",
            KEY,
        ],
        chat_template=TEMPLATE,
    )


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base_url + "/v1", api_key=KEY, max_retries=0)


def test_json_schema_outputs_validate(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        n=4,
        seed=1,
        max_tokens=150,
        response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}},
    )
    assert [c.finish_reason for c in r.choices] == ["stop"] * 4
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_streaming_completion_json_object_and_guided_json(client):
    stream = client.completions.create(
        model="tiny",
        prompt="Hello",
        max_tokens=150,
        seed=3,
        stream=True,
        extra_body={"guided_json": SCHEMA},
    )
    text, reasons = "", []
    for chunk in stream:
        text += chunk.choices[0].text
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    assert reasons == ["stop"]
    jsonschema.validate(json.loads(text), SCHEMA)
    r = client.completions.create(
        model="tiny",
        prompt="Hello",
        max_tokens=5,
        extra_body={"response_format": {"type": "json_object"}},
    )
    c = r.choices[0]
    assert c.text.startswith("{")
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.text), dict)


class Trip(BaseModel):
    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=9)
    pet: bool


def test_parse_with_pydantic(client):
    r = client.chat.completions.parse(
        model="tiny", messages=MESSAGES, response_format=Trip, max_tokens=100, seed=2
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Trip)


def test_regex_choice_and_ebnf(client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=40, n=3, seed=5)
    r = client.chat.completions.create(**kw, extra_body={"guided_regex": r"[a-d]{3}-[0-9]{2}"})
    for c in r.choices:
        assert re.fullmatch(r"[a-d]{3}-[0-9]{2}", c.message.content), c.message.content
    r = client.chat.completions.create(
        **kw, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert {c.message.content for c in r.choices} <= {"yes", "no"}
    grammar = 'root ::= "(" digit ("+" digit){0,3} ")"\ndigit ::= [0-9]'
    r = client.chat.completions.create(**kw, extra_body={"guided_grammar": grammar})
    for c in r.choices:
        assert re.fullmatch(r"\([0-9](\+[0-9]){0,3}\)", c.message.content), c.message.content


def test_structural_tag_response_format(client):
    # vLLM's shape: free text, and every "=" goes on as a tag holding JSON for the schema.
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "=t>", "schema": schema, "end": "</t>"}],
        "triggers": ["="],
    }
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=80, n=6, seed=3, response_format=tag
    )
    bodies = [b for c in r.choices for b in re.findall(r"=t>(.*?)</t>", c.message.content, re.S)]
    assert bodies
    for body in bodies:
        jsonschema.validate(json.loads(body), schema)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            response_format={"type": "structural_tag", "structures": [], "triggers": ["="]},
        )
    assert e.value.body["param"] == "response_format"


def _params(name: str) -> dict:
    return next(t for t in (WEATHER, TIME) if t["function"]["name"] == name)["function"][
        "parameters"
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(client, stream):
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        kw = dict(
            model="tiny",
            messages=[{"role": "user", "content": "weather?"}],
            tools=[WEATHER, TIME],
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=130,
            seed=4,
        )
        if stream:
            with client.chat.completions.stream(**kw) as s:
                fragments = [e for e in s if e.type == "tool_calls.function.arguments.delta"]
                final = s.get_final_completion()
            # The arguments arrive as they are generated, in several fragments.
            assert len(fragments) > 2
        else:
            final = client.chat.completions.create(**kw)
        c = final.choices[0]
        assert c.finish_reason == "tool_calls"
        calls = c.message.tool_calls
        assert calls and all(call.id and call.type == "function" for call in calls)
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), _params(call.function.name))
        if isinstance(choice, dict):
            assert [call.function.name for call in calls] == ["get_time"]


def test_auto_tool_choice_with_the_hermes_parser(client):
    # A constraint makes the random model write a hermes tool call; the parser finds it.
    regex = (
        r'Sure\. <tool_call>\{"name": "get_weather", "arguments": '
        r'\{"city": "(Paris|Rome)", "unit": "C"\}\}</tool_call>'
    )
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER],
        max_tokens=120,
        seed=6,  # the streamed call below is compared with this one
        extra_body={"guided_regex": regex},
    )
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure."
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), _params("get_weather"))
    # Streamed: content before the call, then the call (index, id, name, then arguments).
    content, deltas, reasons = "", [], []
    for chunk in client.chat.completions.create(**kw, stream=True):
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        deltas += ch.delta.tool_calls or []
        reasons += [ch.finish_reason] if ch.finish_reason else []
    assert content.strip() == "Sure." and reasons == ["tool_calls"]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(args) == json.loads(call.function.arguments)


def test_conversation_with_tool_calls_and_results_renders(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "20 C"},
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=4,
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    bare = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather?"}], max_tokens=1
    )
    # The tools, the call and its result all reached the prompt.
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens + 40


def test_bad_schema_is_400_and_the_daemon_keeps_serving(client, daemon):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}},
            },
        )
    assert e.value.body["param"] == "response_format"
    assert "properties must be an object" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, extra_body={"bad_words": ["x"]}
        )
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")
    import urllib.request

    metrics = urllib.request.urlopen(daemon.base_url + "/metrics").read().decode()
    compiles = re.search(
        r"^pagectl:structured_outputs_compiles_total\{engine=\"0\"\} (\S+)$", metrics, re.M
    )
    assert compiles and float(compiles.group(1)) >= 1


def test_mixed_batch_keeps_unconstrained_greedy_tokens(daemon):
    aclient = openai.AsyncOpenAI(base_url=daemon.base_url + "/v1", api_key=KEY, max_retries=0)
    plain = dict(model="tiny", prompt="def add(a, b):", max_tokens=16, temperature=0)
    plain_body = {"ignore_eos": True}

    async def go():
        alone = await aclient.completions.create(**plain, extra_body=plain_body)
        constrained = [
            aclient.completions.create(
                model="tiny",
                prompt="Hello",
                max_tokens=60,
                seed=i,
                extra_body={"guided_json": SCHEMA},
            )
            for i in range(4)
        ]
        mixed = await asyncio.gather(
            *constrained,
            *[aclient.completions.create(**plain, extra_body=plain_body) for _ in range(3)],
        )
        await aclient.close()
        return alone, mixed

    alone, mixed = asyncio.run(go())
    for r in mixed[4:]:
        assert r.choices[0].text == alone.choices[0].text


# -- Anthropic Messages API -----------------------------------------------------------------


@pytest.fixture(scope="module")
def claude(daemon):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=daemon.base_url, api_key=KEY, max_retries=0)


def test_anthropic_messages_create_and_stream(claude):
    kw = dict(
        model="tiny",
        max_tokens=8,
        system="be brief",
        messages=[{"role": "user", "content": "def add(a, b):"}],
        # This SDK version has no temperature / top_k parameters: sent as body fields.
        extra_body={"temperature": 0, "top_k": 5},
    )
    first = claude.messages.create(**kw)
    assert first.type == "message" and first.role == "assistant"
    assert first.stop_reason in ("end_turn", "max_tokens")
    assert first.content[0].type == "text"
    assert first.usage.output_tokens >= 1 and first.usage.input_tokens >= 1
    again = claude.messages.create(**kw)  # the prompt now comes from the prefix cache
    assert again.content[0].text == first.content[0].text
    assert again.usage.cache_read_input_tokens > 0
    with claude.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == first.content[0].text and final.stop_reason == first.stop_reason


def test_anthropic_tools_and_errors(claude):
    import anthropic

    tool = {
        "name": "get_weather",
        "description": "Weather in a city",
        "input_schema": WEATHER["function"]["parameters"],
    }
    kw = dict(
        model="tiny",
        max_tokens=100,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "weather?"}],
    )
    r = claude.messages.create(**kw)
    assert r.stop_reason == "tool_use"
    (use,) = [b for b in r.content if b.type == "tool_use"]
    jsonschema.validate(use.input, tool["input_schema"])
    with claude.messages.stream(**kw) as s:
        final = s.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    jsonschema.validate(streamed.input, tool["input_schema"])
    # "any" (OpenAI's "required"): the call streams as it is generated, in pieces.
    any_one = {"type": "any", "disable_parallel_tool_use": True}
    with claude.messages.stream(**{**kw, "max_tokens": 150, "tool_choice": any_one}) as s:
        pieces = [e for e in s if e.type == "input_json"]
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and len(pieces) > 2
    for block in final.content:
        if block.type == "tool_use":
            jsonschema.validate(block.input, tool["input_schema"])
    # A conversation with the call and its result renders.
    follow = claude.messages.create(
        model="tiny",
        max_tokens=3,
        tools=[tool],
        tool_choice={"type": "none"},
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "20 C"}],
            },
        ],
    )
    assert follow.stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny", max_tokens=5, messages=[])
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        claude.with_options(api_key="wrong").messages.create(
            model="tiny", max_tokens=1, messages=[{"role": "user", "content": "x"}]
        )


def test_prompt_logprobs_per_choice(client):
    r = client.completions.create(
        model="tiny",
        prompt="def add(a, b):",
        max_tokens=2,
        n=2,
        extra_body={"prompt_logprobs": 2},
    )
    n_prompt = r.usage.prompt_tokens
    for choice in r.choices:
        plp = choice.model_extra["prompt_logprobs"]
        assert plp[0] is None and len(plp) == n_prompt
        for entry in plp[1:]:
            assert 1 <= len(entry) <= 3
            assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in entry.values())
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model="tiny", prompt="x", stream=True, extra_body={"prompt_logprobs": 1}
        )
