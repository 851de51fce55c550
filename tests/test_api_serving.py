"""Serving behaviour of the HTTP layer around a real EngineCore (fake model, in process):
SSE framing, stop strings, n > 1, logprobs, echo, cached tokens, aborts on disconnect,
admission control, engine refusals and engine death."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import pytest
from metrics_text import metric_values

from pagectl.server.state import ServerSettings
from pagectl.testing.in_process import InProcessEngine


async def sse_events(resp) -> list:
    """Parse an SSE body strictly: every event is exactly ``data: <payload>\\n\\n``."""
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    raw = (await resp.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    parts = raw.split("\n\n")
    assert parts[-1] == ""
    events = []
    for part in parts[:-1]:
        assert part.startswith("data: ") and "\n" not in part, part
        payload = part[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def fake_tokens(engine: InProcessEngine, prompt: list[int], n: int, index: int = 0) -> list[int]:
    """What the fake model generates for ``prompt`` (greedy, no stops)."""
    ex = engine.core.executor
    toks = list(prompt)
    for _ in range(n):
        toks.append(ex.next_token(SimpleNamespace(all_token_ids=toks, index=index)))
    return toks[len(prompt) :]


def decoded(tok, ids: list[int]) -> str:
    """The text the API should return for ``ids``: exactly a full decode (a trailing
    incomplete UTF-8 sequence is flushed as replacement characters at the end)."""
    return tok.decode(ids)


def kv_idle(engine: InProcessEngine) -> bool:
    sched = engine.core.scheduler
    return sched.kv.pool.num_used_blocks == 0 and not sched.groups


async def wait_for(cond, timeout=5.0):
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


# -- completions --------------------------------------------------------------------------


async def test_completion_text_usage_and_exact_tokens(make_client):
    client, engine = await make_client()
    tok = engine.built.tokenizer
    prompt = [10, 11, 12, 13]
    resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 7})
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    expected = fake_tokens(engine, prompt, 7)
    assert choice["text"] == decoded(tok, expected)
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 7,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert kv_idle(engine)


async def test_streaming_completion_sends_one_chunk_per_token(make_client):
    client, engine = await make_client()
    body = {
        "prompt": [20, 21, 22],
        "max_tokens": 9,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = await sse_events(await client.post("/v1/completions", json=body))
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 18
    assert usage["usage"]["prompt_tokens"] == 3
    by_index = {0: [], 1: []}
    for ch in chunks:
        assert ch["object"] == "text_completion" and "usage" in ch and ch["usage"] is None
        (c,) = ch["choices"]
        by_index[c["index"]].append(c)
    tok = engine.built.tokenizer
    for i in (0, 1):
        assert len(by_index[i]) == 9  # one chunk per token
        reasons = [c["finish_reason"] for c in by_index[i]]
        assert reasons == [None] * 8 + ["length"]  # exactly one finish_reason, last
        text = "".join(c["text"] for c in by_index[i])
        assert text == decoded(tok, fake_tokens(engine, [20, 21, 22], 9, index=i))
    # The two samples differ (the fake model mixes in the sample index).
    assert "".join(c["text"] for c in by_index[0]) != "".join(c["text"] for c in by_index[1])


async def test_multiple_prompts_number_choices_prompt_major(make_client):
    client, engine = await make_client()
    prompts = [[30, 31], [40, 41, 42]]
    resp = await client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 3, "n": 2})
    body = await resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    tok = engine.built.tokenizer
    for c in body["choices"]:
        p, i = divmod(c["index"], 2)
        assert c["text"] == decoded(tok, fake_tokens(engine, prompts[p], 3, index=i))
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 12


async def test_text_prompts_are_tokenized_and_echoed(make_client):
    client, engine = await make_client()
    tok = engine.built.tokenizer
    prompt = "def add(a, b):"
    ids = tok.encode(prompt)
    resp = await client.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "echo": True}
    )
    (c,) = (await resp.json())["choices"]
    assert c["text"] == prompt + decoded(tok, fake_tokens(engine, ids, 4))


async def test_stop_string_cuts_the_text_and_stops_the_engine_sequence(make_client):
    client, engine = await make_client()
    tok = engine.built.tokenizer
    prompt = [50, 51, 52]
    full = decoded(tok, fake_tokens(engine, prompt, 40))
    stop = full[12:15]
    cut = full[: full.index(stop)]
    for stream in (False, True):
        body = {"prompt": prompt, "max_tokens": 40, "stop": [stop, "never-there"], "stream": stream}
        resp = await client.post("/v1/completions", json=body)
        if stream:
            chunks = [e["choices"][0] for e in await sse_events(resp)]
            text = "".join(c["text"] for c in chunks)
            finish = [c["finish_reason"] for c in chunks if c["finish_reason"]]
            assert finish == ["stop"] and chunks[-1]["stop_reason"] == stop
        else:
            (c,) = (await resp.json())["choices"]
            text = c["text"]
            assert (c["finish_reason"], c["stop_reason"]) == ("stop", stop)
        assert text == cut and stop not in text
        await wait_for(lambda: kv_idle(engine))
    # The engine stopped early: far fewer than 2 x 40 tokens were generated.
    assert engine.core.scheduler.counters.generation_tokens < 60


async def test_stop_token_ids_and_min_tokens(make_client):
    client, engine = await make_client()
    prompt = [60, 61]
    toks = fake_tokens(engine, prompt, 20)
    stop_id = toks[5]
    first = toks.index(stop_id)
    resp = await client.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 20, "stop_token_ids": [stop_id]}
    )
    body = await resp.json()
    (c,) = body["choices"]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop_id
    assert body["usage"]["completion_tokens"] == first + 1
    # Before min_tokens tokens are out the stop id does not count: past its only occurrence,
    # the sequence runs to max_tokens.
    assert stop_id not in toks[first + 1 :]
    resp = await client.post(
        "/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": 20,
            "stop_token_ids": [stop_id],
            "min_tokens": first + 2,
        },
    )
    body = await resp.json()
    (c,) = body["choices"]
    assert (c["finish_reason"], c["stop_reason"]) == ("length", None)
    assert body["usage"]["completion_tokens"] == 20


async def test_completion_logprobs_shape(make_client):
    client, engine = await make_client()
    resp = await client.post(
        "/v1/completions", json={"prompt": [70, 71], "max_tokens": 5, "logprobs": 3}
    )
    (c,) = (await resp.json())["choices"]
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(v == -0.25 for v in lp["token_logprobs"])
    assert all(1 <= len(t) <= 3 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


async def test_cached_tokens_are_reported_for_a_repeated_prompt(make_client):
    client, engine = await make_client()
    prompt = list(range(100, 150))  # 3 full blocks of 16
    usages = []
    for _ in range(2):
        resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        usages.append((await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert usages == [0, 48]


# -- chat ---------------------------------------------------------------------------------


async def test_chat_non_streaming_and_streaming(make_client):
    client, engine = await make_client()
    tok = engine.built.tokenizer
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = decoded(tok, fake_tokens(engine, ids, 6))
    resp = await client.post(
        "/v1/chat/completions",
        json={
            "messages": messages,
            "max_completion_tokens": 6,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    body = await resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (c,) = body["choices"]
    assert c["message"] == {"role": "assistant", "content": want}
    assert c["finish_reason"] == "length"
    content = c["logprobs"]["content"]
    assert len(content) == 6 and all(len(e["top_logprobs"]) == 2 for e in content)
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    assert body["usage"]["prompt_tokens"] == len(ids)

    events = await sse_events(
        await client.post(
            "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 6, "stream": True, "n": 2},
        )
    )
    for i in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == i]
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in m["delta"] for m in mine[1:])
        assert len(mine) == 1 + 6
        assert [m["finish_reason"] for m in mine].count("length") == 1
        assert mine[-1]["finish_reason"] == "length"
        text = "".join(m["delta"].get("content", "") for m in mine)
        assert text == decoded(tok, fake_tokens(engine, ids, 6, index=i))


# -- aborts -------------------------------------------------------------------------------


async def test_streaming_client_disconnect_aborts_and_frees_blocks(make_client, monkeypatch):
    monkeypatch.setenv("PAGECTL_FAKE_STEP_DELAY_S", "0.005")
    client, engine = await make_client()
    resp = await client.post(
        "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 200, "stream": True}
    )
    assert resp.status == 200
    seen = 0
    async for line in resp.content:
        if line.startswith(b"data: "):
            seen += 1
            if seen == 3:
                break
    resp.close()
    await wait_for(lambda: engine.aborted)
    await wait_for(lambda: kv_idle(engine))
    assert engine.core.scheduler.counters.generation_tokens < 150


async def test_non_streaming_client_disconnect_aborts(make_client, monkeypatch):
    monkeypatch.setenv("PAGECTL_FAKE_STEP_DELAY_S", "0.005")
    client, engine = await make_client()
    with pytest.raises(asyncio.TimeoutError):
        await client.post(
            "/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 200},
            timeout=aiohttp.ClientTimeout(total=0.2),
        )
    await wait_for(lambda: engine.aborted)
    await wait_for(lambda: kv_idle(engine))


async def test_admission_control_answers_503_with_retry_after(make_client):
    client, engine = await make_client(ServerSettings(max_num_queued_requests=2))
    engine.core.scheduler.set_paused(True)
    body = {"prompt": [5, 6], "max_tokens": 3}
    held = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)]
    await wait_for(lambda: engine.num_unstarted == 2)
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "1"
    assert (await resp.json())["error"]["code"] == "overloaded"
    engine.core.scheduler.set_paused(False)
    engine._wake.set()
    for t in held:
        r = await t
        assert r.status == 200
    assert (await client.post("/v1/completions", json=body)).status == 200


# -- failures inside the engine -----------------------------------------------------------


async def test_a_request_the_engine_refuses_fails_alone(make_client):
    client, engine = await make_client()
    # Make the API's view of the vocabulary wider than the engine's: the engine's own check
    # (second line of defence) refuses the request, and only that request.
    facts = client.server.app[next(iter(client.server.app))].facts
    facts.vocab_size += 1000
    ok = asyncio.create_task(client.post("/v1/completions", json={"prompt": [5], "max_tokens": 5}))
    resp = await client.post("/v1/completions", json={"prompt": [5, facts.vocab_size - 10]})
    assert resp.status == 400
    assert "outside the vocabulary" in (await resp.json())["error"]["message"]
    assert (await ok).status == 200


async def test_a_request_that_cannot_fit_the_kv_pool_fails_alone(make_client):
    client, engine = await make_client(num_kv_blocks=4)  # 64 token slots, max_model_len 256
    ok = asyncio.create_task(client.post("/v1/completions", json={"prompt": [5], "max_tokens": 5}))
    resp = await client.post(
        "/v1/completions", json={"prompt": list(range(3, 103)), "max_tokens": 4}
    )
    assert resp.status == 400
    assert "KV blocks" in (await resp.json())["error"]["message"]
    assert (await ok).status == 200


async def test_engine_death_fails_in_flight_requests_and_health(make_client, monkeypatch):
    monkeypatch.setenv("PAGECTL_FAKE_STEP_DELAY_S", "0.005")
    client, engine = await make_client()
    resp = await client.post(
        "/v1/completions", json={"prompt": [5, 6], "max_tokens": 200, "stream": True}
    )
    await resp.content.readline()
    waiting = asyncio.create_task(
        client.post("/v1/completions", json={"prompt": [7], "max_tokens": 200})
    )
    await asyncio.sleep(0.05)
    engine.kill("engine process exited (test)")
    raw = (await resp.read()).decode()
    assert '"error"' in raw and raw.endswith("data: [DONE]\n\n")
    r2 = await waiting
    assert r2.status == 503 and (await r2.json())["error"]["code"] == "engine_dead"
    assert (await client.get("/health")).status == 503
    r3 = await client.post("/v1/completions", json={"prompt": [5]})
    assert r3.status == 503


# -- the small endpoints ------------------------------------------------------------------


async def test_models_version_tokenize_detokenize(make_client):
    client, engine = await make_client(ServerSettings(served_model_name="tiny"))
    models = await (await client.get("/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == 256
    assert "version" in await (await client.get("/version")).json()
    t = await (await client.post("/tokenize", json={"prompt": "def add(a, b):"})).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == 256
    d = await (await client.post("/detokenize", json={"tokens": t["tokens"]})).json()
    assert d["prompt"] == "def add(a, b):"
    bad = await client.post("/detokenize", json={"tokens": [99999]})
    assert bad.status == 400
    chat = await (
        await client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
    ).json()
    assert chat["count"] > 3


async def test_metrics_names_and_values(make_client):
    client, engine = await make_client()
    await client.post("/v1/completions", json={"prompt": list(range(100, 140)), "max_tokens": 3})
    await client.post("/v1/completions", json={"prompt": list(range(100, 140)), "max_tokens": 3})
    text = await (await client.get("/metrics")).text()
    values = metric_values(text)
    e0 = '{engine="0"}'  # every per-engine series carries the engine label, as vLLM's
    assert values["pagectl:num_requests_running" + e0] == 0
    assert values["pagectl:num_requests_waiting" + e0] == 0
    assert values["pagectl:kv_cache_usage_perc" + e0] == 0
    assert values["pagectl:kv_cache_token_usage_perc" + e0] == 0
    assert values["pagectl:prefix_cache_queries_total" + e0] == 80
    assert values["pagectl:prefix_cache_hits_total" + e0] == 32
    assert values["pagectl:generation_tokens_total" + e0] == 6
    assert values["pagectl:prompt_tokens_total" + e0] == 80 - 32
    assert values['pagectl:request_success_total{finished_reason="length"}'] == 2
    assert values["pagectl:time_to_first_token_seconds_count"] == 2
    assert values["pagectl:inter_token_latency_seconds_count"] == 4
    assert values["pagectl:e2e_request_latency_seconds_count"] == 2
    assert any(
        k.startswith("pagectl:cache_config_info{") and 'block_size="16"' in k for k in values
    )
    assert "# TYPE pagectl:num_preemptions_total counter" in text
    assert not any("_created" in k for k in values)
