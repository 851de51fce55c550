"""Every bad request gets a clear OpenAI-shaped error before anything reaches the engine.

The HTTP layer runs in process (aiohttp_client) around a real EngineCore with a fake model,
so each test can also check that the engine saw nothing.
"""

from __future__ import annotations

import json

import pytest

from pagectl.engine.args import EngineArgs
from pagectl.server.app import create_app
from pagectl.server.errors import APIError
from pagectl.server.json_fields import parse_json
from pagectl.server.state import ServerSettings
from pagectl.server.validation import ModelFacts, parse_chat, parse_completion
from pagectl.testing.fake_engine import fake_engine
from pagectl.testing.in_process import InProcessEngine

MAX_LEN = 256


def assert_openai_error(body: dict, param: str | None = None) -> dict:
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def engine_untouched(engine: InProcessEngine) -> bool:
    sched = engine.core.scheduler
    return not sched.groups and sched.counters.rejected == 0 and sched.counters.steps == 0


# -- JSON that Python accepts and we must not ---------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b'{"temperature": NaN}',
        b'{"temperature": Infinity}',
        b'{"logit_bias": {"5": -Infinity}}',
        b'{"top_p": 1e999}',
        b'{"prompt": "hi",}',
        b"",
    ],
)
def test_parse_json_refuses_non_json_numbers_and_malformed_bodies(raw):
    with pytest.raises(Exception) as ei:
        parse_json(raw)
    assert ei.value.status == 400


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"text"', b"3", b"null"])
def test_parse_json_wants_an_object(raw):
    with pytest.raises(Exception) as ei:
        parse_json(raw)
    assert ei.value.status == 400 and "JSON object" in ei.value.message


# -- 400 cases over HTTP ------------------------------------------------------------------

COMPLETION_400 = [
    # (body, param, words in the message)
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [[]]}, "prompt", "empty"),
    ({"prompt": ["ok", ""]}, "prompt", "empty"),
    ({}, "prompt", "required"),
    ({"prompt": [5, 100000]}, "prompt", "outside the vocabulary"),
    ({"prompt": [5, -1]}, "prompt", "outside the vocabulary"),
    ({"prompt": [5, 2.5]}, "prompt", "prompt must be"),
    ({"prompt": [[5, 6], "mixed"]}, "prompt", "prompt must be"),
    ({"prompt": {"text": "hi"}}, "prompt", "prompt must be"),
    ({"prompt": [5] * 200, "max_tokens": 100}, "prompt", "maximum context length is 256"),
    ({"prompt": [5] * 256, "max_tokens": 1}, "prompt", "257 tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": "hi", "max_tokens": -5}, "max_tokens", ">= 1"),
    ({"prompt": "hi", "max_tokens": "10"}, "max_tokens", "integer"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature", ">= 0"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature", "number"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p", "(0, 1]"),
    ({"prompt": "hi", "top_k": -5}, "top_k", "top_k"),
    ({"prompt": "hi", "min_p": 2}, "min_p", "[0, 1]"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({"prompt": "hi", "frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"prompt": "hi", "n": 0}, "n", ">= 1"),
    ({"prompt": "hi", "n": 1000}, "n", "<= 128"),
    ({"prompt": "hi", "n": True}, "n", "integer"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs", "<= 20"),
    ({"prompt": "hi", "stop": ["s"] * 20}, "stop", "at most 16"),
    ({"prompt": "hi", "stop": [""]}, "stop", "non-empty"),
    ({"prompt": "hi", "stop": 5}, "stop", "string"),
    ({"prompt": "hi", "stop_token_ids": [99999]}, None, "stop_token_ids"),
    ({"prompt": "hi", "stop_token_ids": ["x"]}, "stop_token_ids", "integers"),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias", "not a token id"),
    ({"prompt": "hi", "logit_bias": {"5": 200}}, "logit_bias", "[-100, 100]"),
    ({"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias", "logit_bias key"),
    ({"prompt": "hi", "logit_bias": [1, 2]}, "logit_bias", "object"),
    ({"prompt": "hi", "min_tokens": 20, "max_tokens": 10}, "min_tokens", "<= max_tokens"),
    ({"prompt": "hi", "seed": "x"}, "seed", "integer"),
    ({"prompt": "hi", "seed": 2**70}, "seed", "<="),
    ({"prompt": "hi", "stream": "yes"}, "stream", "true or false"),
    ({"prompt": "hi", "echo": 1}, "echo", "true or false"),
    ({"prompt": "hi", "priority": 1.5}, "priority", "integer"),
    ({"prompt": "hi", "cache_salt": ""}, "cache_salt", "non-empty"),
    ({"prompt": "hi", "suffix": "x"}, "suffix", "not supported"),
    ({"prompt": "hi", "bad_words": ["x"]}, "bad_words", "not supported by pagectl"),
    ({"prompt": "hi", "length_penalty": 0.5}, "length_penalty", "requires use_beam_search"),
    (
        {
            "prompt": "hi",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "object", "properties": 5}},
            },
        },
        "response_format",
        "properties must be an object",
    ),
    ({"prompt": "hi", "best_of": 3}, "best_of", "not supported"),
    ({"prompt": ["p"] * 300}, "prompt", "at most 256"),
    # JSON text nested deeper than the parser goes (it raised RecursionError: a 500).
    ({"prompt": "hi", "guided_json": "[" * 50000}, "guided_json", "nested too deep"),
    (
        {"prompt": "hi", "structured_outputs": {"structural_tag": "[" * 50000 + "]" * 50000}},
        "structured_outputs",
        "nested too deep",
    ),
]


@pytest.mark.parametrize(("body", "param", "words"), COMPLETION_400)
async def test_bad_completion_requests_get_400(make_client, body, param, words):
    client, engine = await make_client()
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 400
    err = assert_openai_error(await resp.json(), param)
    assert err["type"] == "invalid_request_error"
    assert words in err["message"]
    assert engine_untouched(engine)


CHAT_400 = [
    ({}, "messages", "non-empty list"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": "hi"}, "messages", "non-empty list"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "role must be one of"),
    ({"messages": ["hi"]}, "messages", "must be an object"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "string or a list"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages",
        "only text",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        "top_logprobs",
        "requires logprobs",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30},
        "logprobs",
        "<= 20",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10_000},
        "messages",
        "maximum context length",
    ),
    ({"messages": [{"role": "user", "content": "x" * 2000}]}, "messages", "leaving no room"),
    (
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        "tools",
        "needs a string `name`",
    ),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "structural_tag"},
        },
        "response_format",
        "structural_tag needs `structures` and `triggers`",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": 3},
        "truncate_prompt_tokens",
        "`truncate_prompt_tokens` is not supported by pagectl",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'x' }}"},
        "chat_template",
        "--trust-request-chat-template",
    ),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"chat_template": "{{ 'x' }}"},
        },
        "chat_template_kwargs",
        "--trust-request-chat-template",
    ),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        "tool_choice",
        "--enable-auto-tool-choice",
    ),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
        "not in tools",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "guided_json": {"type": "foo"}},
        "guided_json",
        "Unsupported type",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "guided_regex": "a(b"},
        "guided_regex",
        "parenthesis",
    ),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "structured_outputs": {"grammar": "root ::= x"},
        },
        "structured_outputs",
        "not defined",
    ),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "guided_choice": ["a"],
            "guided_regex": "a",
        },
        "guided_choice",
        "one constraint",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1},
        "prompt_logprobs",
        "not supported by pagectl",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 500}, "n", "<= 128"),
]


@pytest.mark.parametrize(("body", "param", "words"), CHAT_400)
async def test_bad_chat_requests_get_400(make_client, body, param, words):
    client, engine = await make_client()
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 400
    err = assert_openai_error(await resp.json(), param)
    assert words in err["message"]
    assert engine_untouched(engine)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "hi", "temperature": NaN}',
        b'{"prompt": "hi", "top_p": Infinity}',
        b'{"prompt": "hi", "frequency_penalty": -Infinity}',
        b'{"prompt": "hi", "logit_bias": {"5": NaN}}',
        b'{"prompt": "hi", "min_p": 1e400}',
        b'{"prompt": "hi"',
        b"[]",
        b'"prompt"',
    ],
)
async def test_nan_infinity_and_malformed_json_get_400(make_client, raw):
    client, engine = await make_client()
    for path in ("/v1/completions", "/v1/chat/completions"):
        resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        assert resp.status == 400
        assert_openai_error(await resp.json())
    assert engine_untouched(engine)


async def test_wrong_content_type_gets_400(make_client):
    client, engine = await make_client()
    body = json.dumps({"prompt": "hi"})
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):
        resp = await client.post("/v1/completions", data=body, headers={"Content-Type": ctype})
        assert resp.status == 400
        err = assert_openai_error(await resp.json())
        assert "application/json" in err["message"]
    resp = await client.post("/v1/completions", data=body.encode())  # no content type at all
    assert resp.status == 400
    # A charset parameter is fine.
    resp = await client.post(
        "/v1/completions",
        data=json.dumps({"prompt": "hi", "max_tokens": 2}),
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert resp.status == 200
    assert engine.core.scheduler.counters.steps > 0


async def test_unknown_model_gets_404_and_the_served_name_works(make_client):
    client, engine = await make_client(ServerSettings(served_model_name="tiny"))
    resp = await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert resp.status == 404
    err = assert_openai_error(await resp.json(), "model")
    assert err["code"] == "model_not_found" and "gpt-9" in err["message"]
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
    )
    assert resp.status == 404
    assert engine_untouched(engine)
    resp = await client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}
    )
    assert resp.status == 200
    assert (await resp.json())["model"] == "tiny"


async def test_oversized_body_gets_413(make_client):
    client, engine = await make_client(ServerSettings(max_body_size=4096))
    big = json.dumps({"prompt": "x" * 10_000})
    resp = await client.post(
        "/v1/completions", data=big, headers={"Content-Type": "application/json"}
    )
    assert resp.status == 413
    err = assert_openai_error(await resp.json())
    assert err["code"] == "request_too_large"

    # Chunked: no Content-Length up front, the limit still holds.
    async def chunks():
        for _ in range(10):
            yield b" " * 1000

    resp = await client.post(
        "/v1/completions", data=chunks(), headers={"Content-Type": "application/json"}
    )
    assert resp.status == 413
    assert_openai_error(await resp.json())
    assert engine_untouched(engine)


async def test_unknown_routes_and_methods_answer_in_the_openai_shape(make_client):
    client, _ = await make_client()
    resp = await client.get("/v1/nothing")
    assert resp.status == 404
    assert_openai_error(await resp.json())
    resp = await client.get("/v1/completions")
    assert resp.status == 405
    assert_openai_error(await resp.json())
    assert "POST" in resp.headers["Allow"]


# -- auth ---------------------------------------------------------------------------------


async def test_api_key_protects_everything_but_the_allow_list(make_client):
    client, engine = await make_client(ServerSettings(api_keys=["k-123"]))
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "k-123"},
        {"Authorization": "Basic k-123"},
        {"Authorization": "Bearer k-1234"},
    ):
        resp = await client.post("/v1/completions", json=body, headers=headers)
        assert resp.status == 401, headers
        err = assert_openai_error(await resp.json())
        assert err["code"] == "invalid_api_key"
    for path in ("/v1/models", "/version"):
        assert (await client.get(path)).status == 401
    assert (await client.post("/tokenize", json={"prompt": "a"})).status == 401
    assert engine_untouched(engine)
    # The allow-list, without a key.
    assert (await client.get("/health")).status == 200
    assert (await client.get("/metrics")).status == 200
    good = {"Authorization": "Bearer k-123"}
    resp = await client.post("/v1/completions", json=body, headers=good)
    assert resp.status == 200
    assert (await client.get("/v1/models", headers=good)).status == 200


async def test_custom_allow_list(make_client):
    client, _ = await make_client(ServerSettings(api_keys=["k"], auth_allow=("/health",)))
    assert (await client.get("/health")).status == 200
    assert (await client.get("/metrics")).status == 401


# -- the model's default sampling parameters ---------------------------------------------


def test_unset_fields_take_the_models_defaults(tok_dir):
    from pagectl.engine.tokenizer import load_tokenizer

    defaults = {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 40}
    facts = ModelFacts("m", 384, 100, load_tokenizer(str(tok_dir)), defaults)
    p = parse_completion({"prompt": [1, 2, 3]}, facts).params
    assert (p.temperature, p.top_k, p.repetition_penalty, p.max_tokens) == (0.6, 20, 1.1, 40)
    p = parse_completion({"prompt": [1, 2], "temperature": 0, "max_tokens": 7}, facts).params
    assert (p.temperature, p.top_k, p.max_tokens) == (0, 20, 7)  # the request's own win
    # A default max_tokens shrinks to the room the context leaves; an explicit one is refused.
    assert parse_completion({"prompt": [1] * 90}, facts).params.max_tokens == 10
    with pytest.raises(APIError, match="maximum context length is 100"):
        parse_completion({"prompt": [1] * 90, "max_tokens": 11}, facts)
    with pytest.raises(APIError, match="leaving no room"):
        parse_completion({"prompt": [1] * 100}, facts)
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, facts).params
    assert (chat.temperature, chat.max_tokens) == (0.6, 40)
    # Without model defaults: OpenAI's (16 tokens for completions, the context for chat).
    plain = ModelFacts("m", 384, 100, load_tokenizer(str(tok_dir)))
    p = parse_completion({"prompt": [1, 2, 3]}, plain).params
    assert (p.temperature, p.top_k, p.max_tokens) == (1.0, 0, 16)
    assert parse_completion({"prompt": [1] * 95}, plain).params.max_tokens == 5
    assert (
        parse_chat({"messages": [{"role": "user", "content": "hi"}]}, plain).params.max_tokens
        is None
    )


async def test_daemon_applies_the_engines_sampling_defaults(aiohttp_client, tok_dir):
    built = fake_engine(EngineArgs(model=str(tok_dir), num_kv_blocks=64, max_model_len=MAX_LEN))
    built.sampling_defaults = {"max_tokens": 5}
    engine = InProcessEngine(built)
    client = await aiohttp_client(create_app(ServerSettings(), engine))
    resp = await client.post("/v1/completions", json={"prompt": "hi", "ignore_eos": True})
    assert resp.status == 200
    assert (await resp.json())["usage"]["completion_tokens"] == 5
