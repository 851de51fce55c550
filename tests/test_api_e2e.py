"""End to end: a real ``pagectl daemon`` subprocess serving a tiny Qwen3 checkpoint, driven
with the official openai SDK and raw HTTP."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

pytestmark = pytest.mark.slow

NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def daemon(tiny_daemon):
    return tiny_daemon(
        [
            "--num-kv-blocks",
            "256",
            "--max-num-seqs",
            "64",
            "--dtype",
            "float32",
        ]
    )


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base_url + "/v1", api_key="unused", max_retries=0)


def status(daemon) -> dict:
    r = daemon.ctl("status", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_completions_greedy_usage_and_cached_tokens(client):
    prompt = "def add(a, b):\n    return a + b\n\nclass Stack:\n    def __init__(self):\n"
    first = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body=NO_EOS
    )
    second = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body=NO_EOS
    )
    assert first.object == "text_completion"
    assert first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 12
    n_prompt = first.usage.prompt_tokens
    assert n_prompt > 16 and first.usage.total_tokens == n_prompt + 12
    assert first.choices[0].text == second.choices[0].text  # greedy is deterministic
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Full blocks of the repeated prompt come from the prefix cache.
    assert second.usage.prompt_tokens_details.cached_tokens == (n_prompt - 1) // 16 * 16 > 0


def test_streaming_completion_matches_non_streaming(client):
    kw = dict(
        model="tiny",
        prompt="import os\nimport sys\n",
        max_tokens=10,
        temperature=0,
        extra_body=NO_EOS,
    )
    full = client.completions.create(**kw).choices[0].text
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    *token_chunks, usage_chunk = chunks
    assert len(token_chunks) == 10  # one chunk per token
    assert "".join(c.choices[0].text for c in token_chunks) == full
    assert [c.choices[0].finish_reason for c in token_chunks].count("length") == 1
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10


def test_chat_non_streaming_and_streaming(client):
    messages = [{"role": "user", "content": "Hello world!"}]
    resp = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, extra_body=NO_EOS
    )
    assert resp.object == "chat.completion"
    msg = resp.choices[0].message
    assert msg.role == "assistant" and resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_completion_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_EOS,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert (
        chunks[-1].usage.completion_tokens == 8
        and chunks[-1].usage.prompt_tokens == resp.usage.prompt_tokens
    )


def test_parallel_sampling_is_seeded(client):
    kw = dict(
        model="tiny",
        prompt="for i in range(10):",
        max_tokens=8,
        n=3,
        temperature=1.0,
        seed=1234,
        extra_body=NO_EOS,
    )
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 24
    assert a.usage.prompt_tokens == b.usage.prompt_tokens  # the prompt counts once, not n times


def test_stop_strings_cut_the_text(client):
    kw = dict(
        model="tiny", prompt="The quick brown fox", max_tokens=30, temperature=0, extra_body=NO_EOS
    )
    full = client.completions.create(**kw).choices[0].text
    stop = full[8:10]
    assert stop and full.index(stop) >= 1
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == cut.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs(client):
    c = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=3, extra_body=NO_EOS
    ).choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        # Greedy: the chosen token is the most likely one.
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
        assert chosen <= 0
    echo = client.completions.create(
        model="tiny",
        prompt="Hello world",
        max_tokens=3,
        temperature=0,
        logprobs=1,
        echo=True,
        extra_body=NO_EOS,
    )
    lp = echo.choices[0].logprobs
    n_prompt = echo.usage.prompt_tokens
    assert echo.choices[0].text.startswith("Hello world")
    assert len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None  # the first prompt token has no logprob
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=NO_EOS,
    ).choices[0]
    content = chat.logprobs.content
    assert len(content) == 4
    assert all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5) for t in content)


def test_errors_through_the_sdk(client):
    with pytest.raises(openai.NotFoundError) as ei:
        client.completions.create(model="gpt-9", prompt="x")
    assert "gpt-9" in ei.value.body["message"]
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="tiny", prompt="x", max_tokens=100_000)
    assert "maximum context length" in ei.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=[1, 2, 10**6])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)


async def test_raw_http_sse_framing_and_error_cases(daemon):
    url = daemon.base_url
    async with aiohttp.ClientSession() as s:
        body = {
            "model": "tiny",
            "prompt": "class",
            "max_tokens": 5,
            "stream": True,
            "n": 2,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            raw = (await r.read()).decode()
        events = raw.split("\n\n")
        assert events[-1] == "" and events[-2] == "data: [DONE]"
        data = [json.loads(e[6:]) for e in events[:-2]]
        assert all(e.startswith("data: {") for e in events[:-2])
        assert len(data) == 2 * 5 + 1 and data[-1]["usage"]["completion_tokens"] == 10
        async with s.post(
            url + "/v1/completions",
            data=b'{"prompt": "x", "temperature": NaN}',
            headers={"Content-Type": "application/json"},
        ) as r:
            assert r.status == 400
            assert set((await r.json())["error"]) == {"message", "type", "param", "code"}
        async with s.post(url + "/v1/completions", data="prompt=x") as r:
            assert r.status == 400
        async with s.post(
            url + "/v1/completions",
            data=b"x" * (9 * 1024 * 1024),
            headers={"Content-Type": "application/json"},
        ) as r:
            assert r.status == 413
        for path in ("/health", "/version", "/v1/models", "/metrics"):
            async with s.get(url + path) as r:
                assert r.status == 200, path


async def test_abort_many_streams_others_exact_and_kv_returns_to_zero(daemon, client):
    """vLLM's abort test, smaller: concurrent streams, some cancelled mid-way; every other
    stream finishes with exactly its expected text, and the KV cache empties."""
    prompts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(24)]
    max_tokens = 24
    expected = {}
    for p in prompts[::3]:  # a sample of reference outputs, each run alone
        expected[p] = (
            client.completions.create(
                model="tiny", prompt=p, max_tokens=max_tokens, temperature=0, extra_body=NO_EOS
            )
            .choices[0]
            .text
        )
    cancel = set(prompts[1::4])

    async def one(s: aiohttp.ClientSession, prompt: str):
        body = {
            "model": "tiny",
            "prompt": prompt,
            # A stream to cancel asks for many more tokens than it reads, so it cannot run to
            # its length before the closed connection reaches the engine (at 24 tokens, a
            # fast engine finished some of them first: fewer aborts than cancels).
            "max_tokens": 400 if prompt in cancel else max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        text, n = "", 0
        async with s.post(daemon.base_url + "/v1/completions", json=body) as r:
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                text += chunk["choices"][0]["text"]
                n += 1
                if prompt in cancel and n == 3:
                    return prompt, None, n  # leaving the block closes the connection
        return prompt, text, n

    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*(one(s, p) for p in prompts))
    for prompt, text, n in results:
        if prompt in cancel:
            assert text is None and n == 3
            continue
        assert n == max_tokens
        if prompt in expected:
            assert text == expected[prompt], prompt
    for _ in range(100):
        st = status(daemon)
        if st["kv"]["num_used_blocks"] == 0 and not st["requests"]:
            break
        await asyncio.sleep(0.1)
    assert st["kv"]["num_used_blocks"] == 0 and st["requests"] == []
    assert st["counters"]["finished_by_reason"].get("abort", 0) >= len(cancel)
    async with aiohttp.ClientSession() as s, s.get(daemon.base_url + "/metrics") as r:
        metrics = await r.text()
    assert 'pagectl:kv_cache_usage_perc{engine="0"} 0.0' in metrics
    assert 'pagectl:num_requests_running{engine="0"} 0.0' in metrics
