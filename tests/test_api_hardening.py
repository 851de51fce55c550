"""Values no later stage can carry get a 400 up front, and no request leaks an admission slot.

Found by an adversarial run: integers past int64 or past float range, lone surrogates, and
``chat_template_kwargs.return_tensors`` used to fail late with a 500; a request that failed
while being sent to the engine kept its admission slot, so three of them under
``--max-num-queued-requests 3`` locked the server out with 503 until a restart.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from test_api_errors import assert_openai_error

from pagectl.engine.outputs import EngineRequest
from pagectl.engine_process.client import EngineClient, RequestRejected
from pagectl.engine_process.main import EngineProcConfig
from pagectl.server.field_checks import check_body
from pagectl.server.state import ServerSettings

SURROGATE = "\ud800"


def raw_json(body: dict) -> bytes:
    # json.dumps writes a lone surrogate as the escape "\ud800", as a hostile client would.
    return json.dumps(body).encode()


async def post(client, path: str, body: dict):
    resp = await client.post(
        path, data=raw_json(body), headers={"Content-Type": "application/json"}
    )
    return resp.status, await resp.json()


def slots_free(engine) -> bool:
    return engine.num_unstarted == 0 and not engine._routes


LOCKOUT_BODIES = [
    {"prompt": "hi", "max_tokens": 2, "priority": 2**64},
    {"prompt": "hi", "max_tokens": 2, "priority": -(2**63) - 1},
    {"prompt": "hi", "max_tokens": 2, "top_k": 2**64},
    {"prompt": "hi", "max_tokens": 2, "top_k": -(2**63) - 1},
    {"prompt": "hi", "max_tokens": 2, "cache_salt": "salt" + SURROGATE},
    {"prompt": "hi", "max_tokens": 2, "stop": ["ok", SURROGATE]},
    {"prompt": "hi", "max_tokens": 2, "stop": SURROGATE + "x"},
]


async def test_bad_values_under_a_queue_limit_of_3_get_400_and_never_lock_out(make_client):
    client, engine = await make_client(
        ServerSettings(max_num_queued_requests=3), scheduling_policy="priority"
    )
    for _ in range(2):  # more bad requests than the queue limit, twice over
        for body in LOCKOUT_BODIES:
            status, err = await post(client, "/v1/completions", body)
            assert status == 400, (body, err)
            assert_openai_error(err)
            assert slots_free(engine)
    status, ok = await post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200, ok
    assert ok["choices"][0]["finish_reason"] == "length"
    assert slots_free(engine)


OUT_OF_RANGE_400 = [
    {"temperature": 10**400},
    {"top_p": 10**400},
    {"min_p": 10**400},
    {"presence_penalty": 10**400},
    {"frequency_penalty": -(10**400)},
    {"repetition_penalty": 10**400},
    {"logit_bias": {"5": 10**400}},
    {"seed": 2**64},
    {"n": 2**64},
    {"min_tokens": 2**70},
    {"max_tokens": 2**64},
    {"logprobs": 2**64},
]


@pytest.mark.parametrize("field", OUT_OF_RANGE_400, ids=lambda f: next(iter(f)))
async def test_integers_beyond_int64_or_float_range_get_400(make_client, field):
    client, engine = await make_client()
    status, err = await post(client, "/v1/completions", {"prompt": "hi", **field})
    assert status == 400, err
    assert_openai_error(err, next(iter(field)))
    status, err = await post(
        client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **field}
    )
    assert status == 400, err
    assert slots_free(engine)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "hi" + SURROGATE}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", SURROGATE]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "user": SURROGATE}, "user"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": SURROGATE}]},
            "messages",
        ),
        ("/tokenize", {"prompt": "a" + SURROGATE + "b"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages"),
        ("/v1/completions", {"prompt": "hi", SURROGATE: 1}, None),
    ],
)
async def test_lone_surrogates_get_400(make_client, path, body, param):
    client, engine = await make_client()
    status, err = await post(client, path, body)
    assert status == 400, err
    e = assert_openai_error(err, param)
    assert "surrogate" in e["message"]
    assert slots_free(engine)


@pytest.mark.parametrize("key", ["return_tensors", "tokenize", "return_dict", "conversation"])
async def test_chat_template_kwargs_that_change_the_call_get_400(make_client, key):
    client, engine = await make_client()
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "chat_template_kwargs": {key: "pt"},
    }
    for path in ("/v1/chat/completions", "/tokenize"):
        status, err = await post(client, path, body)
        assert status == 400, err
        assert_openai_error(err, "chat_template_kwargs")
    body["chat_template_kwargs"] = {"enable_thinking": False}  # a template variable: fine
    status, ok = await post(client, "/v1/chat/completions", body)
    assert status == 200, ok


async def test_detokenize_refuses_strings(make_client):
    client, _ = await make_client()
    for tokens in (["hello"], ["hello", "world"], [5, "x"]):
        status, err = await post(client, "/detokenize", {"tokens": tokens})
        assert status == 400, err
        assert_openai_error(err, "tokens")
    status, ok = await post(client, "/detokenize", {"tokens": [72, 105]})
    assert status == 200 and isinstance(ok["prompt"], str)


def test_check_body_walks_keys_and_nested_values_and_skips_clean_bodies():
    check_body({"a": [1, {"b": 2**63 - 1}], "c": "\U0001f600"}, None)
    for bad in ({"a": [{"b": 2**63}]}, {"x": {"y": [SURROGATE]}}, {"x": {SURROGATE: 1}}):
        with pytest.raises(Exception) as ei:
            check_body(bad, raw_json(bad))
        assert ei.value.status == 400 and ei.value.param in ("a", "x")
    # A body without long digit runs or surrogate escapes is not walked at all.
    check_body({"a": 2**70}, b'{"a": 1}')


async def test_a_request_msgpack_cannot_carry_fails_at_submit_and_leaves_no_route():
    client = EngineClient(
        EngineProcConfig(
            engine_args={},
            input_endpoint="",
            output_endpoint="",
            telemetry_endpoint="",
            control_endpoint="",
            token_file="",
        ),
        input_endpoint="inproc://unused-in",
        output_endpoint="inproc://unused-out",
    )
    try:
        req = EngineRequest(
            request_id="r", prompt_token_ids=[1], sampling_params={}, priority=2**64
        )
        with pytest.raises(RequestRejected):
            client.submit(req, asyncio.Queue())
        assert client.num_unstarted == 0 and not client._routes
    finally:
        client.ctx.term()


async def test_the_slot_comes_back_when_submit_raises_anything(make_client, monkeypatch):
    client, engine = await make_client(ServerSettings(max_num_queued_requests=1))

    def broken(request, queue):
        engine._add_route(request.request_id, queue)
        raise RuntimeError("a bug between routing and sending")

    monkeypatch.setattr(engine, "submit", broken)
    for _ in range(3):
        resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert resp.status == 500
        assert slots_free(engine)
    monkeypatch.undo()
    resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert resp.status == 200
