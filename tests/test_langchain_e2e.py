"""End to end through a real ``pagectl daemon`` on the tiny Qwen3 checkpoint (one daemon for
the module, run with ``--reasoning-parser qwen3`` and n-gram speculation): LangChain's ``ChatOpenAI`` (tool binding,
the three ``with_structured_output`` methods, streamed tool calls), and reasoning content in
messages and streaming deltas.

``ChatOpenAI`` counts tokens with tiktoken only in ``get_num_tokens``; every client here
gets a ``custom_get_token_ids`` that fails the test, so nothing reaches tiktoken (which
would download its encodings)."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pagectl.testing.daemon_process import DaemonProcess

pytestmark = pytest.mark.slow
langchain_openai = pytest.importorskip("langchain_openai")

KEY = "sk-test"
# A daemon --chat-template that names the tools (in few tokens: the tiny model has 512
# positions).
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": WEATHER_PARAMS,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
        },
    },
}


def _no_tiktoken(text: str) -> list[int]:
    raise AssertionError("ChatOpenAI reached its tiktoken token counter")


@pytest.fixture(scope="module")
def daemon(structured_daemon):
    return structured_daemon(
        [
            "--reasoning-parser",
            "qwen3",
            # Constrained sequences speculate too: every test here runs through it.
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}',
            "--api-key",
            KEY,
        ],
        chat_template=TEMPLATE,
        positional_model=True,
    )


def chat(daemon: DaemonProcess, **kw):
    return langchain_openai.ChatOpenAI(
        model="tiny",
        base_url=daemon.base_url + "/v1",
        api_key=KEY,
        max_retries=0,
        custom_get_token_ids=_no_tiktoken,
        **kw,
    )


def _validate_call(call: dict) -> None:
    schema = {"get_weather": WEATHER_PARAMS, "get_time": TIME["function"]["parameters"]}
    jsonschema.validate(call["args"], schema[call["name"]])
    assert call["id"].startswith("call_")


def test_bind_tools_invoke_returns_tool_calls(daemon):
    llm = chat(daemon, max_tokens=120, seed=1)
    named = llm.bind_tools([WEATHER, TIME], tool_choice="get_weather").invoke("weather?")
    assert [c["name"] for c in named.tool_calls] == ["get_weather"]
    assert named.response_metadata["finish_reason"] == "tool_calls"
    _validate_call(named.tool_calls[0])
    # "any" is LangChain's word for OpenAI's "required".
    anyone = llm.bind_tools([WEATHER, TIME], tool_choice="any", parallel_tool_calls=False)
    msg = anyone.invoke("weather or time?")
    assert len(msg.tool_calls) == 1 and not msg.invalid_tool_calls
    _validate_call(msg.tool_calls[0])


class Trip(BaseModel):
    """A trip plan."""

    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=9)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_schema_methods(daemon, method):
    llm = chat(daemon, max_tokens=100, seed=2)
    out = llm.with_structured_output(Trip, method=method, include_raw=True).invoke("trip?")
    assert out["parsing_error"] is None
    assert isinstance(out["parsed"], Trip)
    raw = out["raw"]
    if method == "function_calling":
        assert [c["name"] for c in raw.tool_calls] == ["Trip"]
    else:
        assert Trip.model_validate_json(raw.content) == out["parsed"]


class Note(BaseModel):
    """Any JSON object fits: json_mode constrains the output to an object, not a schema."""

    model_config = {"extra": "allow"}
    title: str | None = None


def test_with_structured_output_json_mode(daemon):
    # A random-weight model writes arbitrary keys under json_object; this seed closes the
    # object within the limit.
    llm = chat(daemon, max_tokens=120, seed=0)
    out = llm.with_structured_output(Note, method="json_mode", include_raw=True).invoke(
        "Answer in JSON."
    )
    assert out["parsing_error"] is None
    assert out["raw"].response_metadata["finish_reason"] == "stop"
    assert isinstance(json.loads(out["raw"].content), dict)
    assert isinstance(out["parsed"], Note)


@pytest.mark.parametrize("tool_choice", ["any", "get_time"])
def test_streamed_tool_calls_assemble(daemon, tool_choice):
    llm = chat(daemon, max_tokens=120, seed=3).bind_tools(
        [WEATHER, TIME], tool_choice=tool_choice, parallel_tool_calls=False
    )
    total = None
    fragments = 0
    for chunk in llm.stream("time?"):
        total = chunk if total is None else total + chunk
        fragments += sum(1 for c in chunk.tool_call_chunks if c["args"])
    # The arguments arrive as they are generated, in several fragments.
    assert total is not None and fragments > 2
    assert len(total.tool_calls) == 1 and not total.invalid_tool_calls
    _validate_call(total.tool_calls[0])
    if tool_choice == "get_time":
        assert total.tool_calls[0]["name"] == "get_time"
    # The same request, not streamed, gives the same call (greedy by seed).
    whole = llm.invoke("time?")
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [
        (c["name"], c["args"]) for c in total.tool_calls
    ]


# -- reasoning (--reasoning-parser qwen3) ----------------------------------------------------

# A constraint makes the random model think first, then answer.
THINKING = r"<think>[a-z]{2,6}( [a-z]{2,6}){1,3}</think>\n\n(yes|no)"


def test_reasoning_content_in_message_and_stream(daemon):
    client = openai.OpenAI(base_url=daemon.base_url + "/v1", api_key=KEY, max_retries=0)
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "yes or no?"}],
        max_tokens=60,
        seed=4,
        extra_body={"guided_regex": THINKING},
    )
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert msg.content.strip() in ("yes", "no")
    streamed_reasoning, streamed_content = "", ""
    reasoning_deltas = 0
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        part = (delta.model_extra or {}).get("reasoning_content")
        if part:
            streamed_reasoning += part
            reasoning_deltas += 1
        streamed_content += delta.content or ""
    assert streamed_reasoning == reasoning and reasoning_deltas >= 2
    assert streamed_content.strip() == msg.content.strip()
    # A reply without <think> has no reasoning: everything is content.
    plain = client.chat.completions.create(
        **{**kw, "extra_body": {"guided_choice": ["maybe"]}}
    ).choices[0]
    assert plain.message.content == "maybe"
    assert plain.message.model_extra.get("reasoning_content") is None


def test_langchain_content_leaves_the_reasoning_out(daemon):
    # ChatOpenAI keeps no reasoning_content; what matters is that the thinking is not in
    # the content it shows.
    llm = chat(daemon, max_tokens=60, seed=4, extra_body={"guided_regex": THINKING})
    msg = llm.invoke("yes or no?")
    assert msg.content.strip() in ("yes", "no")


def test_constrained_requests_speculated(daemon):
    # Every request of this module is constrained; this one repeats itself, so n-gram
    # lookup proposes tokens, which the grammar checks.
    import urllib.request

    def drafts() -> float:
        metrics = urllib.request.urlopen(daemon.base_url + "/metrics").read().decode()
        found = re.search(
            r"^pagectl:spec_decode_num_drafts_total(?:\{[^}]*\})? (\S+)$", metrics, re.M
        )
        return float(found.group(1)) if found else 0.0

    client = openai.OpenAI(base_url=daemon.base_url + "/v1", api_key=KEY, max_retries=0)
    before = drafts()
    r = client.completions.create(
        model="tiny",
        prompt="ab ab ab ab",
        max_tokens=40,
        temperature=0,
        extra_body={"guided_regex": r"(ab ){8,12}ab\."},
    )
    assert re.fullmatch(r"(ab ){8,12}ab\.", r.choices[0].text)
    assert drafts() > before  # this request was speculated, not only earlier ones
