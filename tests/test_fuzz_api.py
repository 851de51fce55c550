"""A fuzzer that stays: valid requests mutated one field at a time, against the real app.

Each example takes a valid request to one endpoint and replaces (or adds) one field with a
hostile value: integers past int64 and float range, NaN and infinities, lone surrogates,
deep nesting, megabyte strings, wrong types. Whatever the value, the server must answer
below 500 in OpenAI's error shape, and afterwards hold no admission slot, no routed request
and no KV block; after the run a fresh request is served.

The app runs with an in-process engine (fake model, tiny tokenizer) behind
``GuardedAppRunner`` on a loopback port, in its own thread and event loop. The default
budget is small (CI); ``--extended`` runs a larger one.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_api_errors import assert_openai_error

from pagectl.engine.args import EngineArgs
from pagectl.server.app import create_app
from pagectl.server.connections import ConnectionLimits, GuardedAppRunner
from pagectl.server.state import STATE, ServerSettings
from pagectl.testing.fake_engine import fake_engine
from pagectl.testing.in_process import InProcessEngine

BASES = {
    "/v1/completions": {
        "prompt": "def f(x):",
        "max_tokens": 3,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "stop": ["\n\n"],
        "seed": 1,
        "logprobs": 2,
        "stream": False,
    },
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.1,
        "logit_bias": {"5": 1.0},
        "priority": 0,
        "cache_salt": "s",
        "stream": True,
    },
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [72, 105]},
}
EXTRA_FIELDS = [
    "n",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "stop_token_ids",
    "echo",
    "user",
    "model",
    "chat_template_kwargs",
    "stream_options",
    "response_format",
    "ignore_eos",
    "max_completion_tokens",
    "top_logprobs",
    "add_special_tokens",
    "messages",
    "prompt",
]


class _Nested:
    """A JSON array nested ``depth`` deep, written as text (deeper than ``json.dumps`` goes)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def __repr__(self) -> str:
        return f"_Nested({self.depth})"


def _nested(depth: int, leaf=1) -> _Nested:
    return _Nested(depth)


def _encode(body: dict) -> bytes:
    marks: dict[str, _Nested] = {}

    def default(o):
        if isinstance(o, _Nested):
            key = f"@@nested{len(marks)}@@"
            marks[key] = o
            return key
        raise TypeError(type(o))

    text = json.dumps(body, allow_nan=True, default=default)
    for key, n in marks.items():
        text = text.replace(json.dumps(key), "[" * n.depth + "1" + "]" * n.depth)
    return text.encode("utf-8", "surrogatepass")


HOSTILE = st.one_of(
    st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**400, -(10**400), 2**1000]),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -0.0, 5e-324]),
    st.sampled_from(["\ud800", "a\udfffb", "\udc00" * 3, "", "\x00", "\U0010ffff"]),
    st.integers(min_value=2, max_value=3000).map(_nested),
    st.sampled_from([1, 1000, 1_000_000]).map(lambda n: "x" * n),
    st.sampled_from([None, True, False, {}, [], {"a": 1}, [None], ["x", 1], {"\ud800": 1}]),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.lists(st.integers(min_value=-5, max_value=10**6), max_size=5),
)


class _Served:
    """The app on a loopback port, run by its own event loop in a thread."""

    def __init__(self, tok_dir) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(tok_dir,), daemon=True)
        self.thread.start()
        assert self._ready.wait(60), "the app did not start"

    def _run(self, tok_dir) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start(tok_dir))
        self._ready.set()
        self.loop.run_forever()

    async def _start(self, tok_dir) -> None:
        args = EngineArgs(
            model=str(tok_dir), num_kv_blocks=64, max_num_batched_tokens=64, max_model_len=256
        )
        self.engine = InProcessEngine(fake_engine(args))
        limits = ConnectionLimits()
        self.app = create_app(ServerSettings(connection_limits=limits), self.engine)
        self.runner = GuardedAppRunner(self.app, limits, handler_cancellation=True)
        await self.runner.setup()
        site = __import__("aiohttp").web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def call(self, fn):
        """``fn()`` on the app's loop (reads engine state without racing a step)."""

        async def run():
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def leftovers(self) -> dict:
        def read():
            eng = self.engine
            return {
                "slots": self.app[STATE].num_active,
                "unstarted": eng.num_unstarted,
                "routes": len(eng._routes),
                "blocks": eng.core.scheduler.kv.pool.num_used_blocks,
                "running": eng.core.has_unfinished(),
            }

        return self.call(read)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def served(tok_dir):
    s = _Served(tok_dir)
    yield s
    s.close()


def _clean(served: _Served) -> dict:
    deadline = time.monotonic() + 5
    left = served.leftovers()
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(0.02)
        left = served.leftovers()
    return left


def _check_one(served: _Served, path: str, field: str, value) -> None:
    body = dict(BASES[path])
    body[field] = value
    data = _encode(body)
    r = requests.post(
        served.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=60
    )
    raw = r.content
    assert r.status_code < 500, (path, field, r.status_code, raw[:300])
    if r.status_code >= 400:
        assert_openai_error(r.json())
    elif body.get("stream") is True and path != "/tokenize":
        assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
    left = _clean(served)
    assert not any(left.values()), (path, field, left)


def _fuzz(served: _Served, data) -> None:
    path = data.draw(st.sampled_from(sorted(BASES)), label="path")
    field = data.draw(st.sampled_from(sorted(set(BASES[path]) | set(EXTRA_FIELDS))), "field")
    value = data.draw(HOSTILE, label="value")
    _check_one(served, path, field, value)


_SETTINGS = dict(
    deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)


@settings(max_examples=60, **_SETTINGS)
@given(data=st.data())
def test_fuzz_one_field_at_a_time_small_budget(served, data):
    _fuzz(served, data)


@pytest.mark.extended
@settings(max_examples=3000, **_SETTINGS)
@given(data=st.data())
def test_fuzz_one_field_at_a_time_extended(served, data):
    _fuzz(served, data)


def test_the_named_hostile_values_on_every_base_field(served):
    """Deterministic floor under the fuzzer: each named kind on every field of each base."""
    values = [10**400, 2**64, float("nan"), "\ud800", _nested(2000), {"\ud800": [2**70]}]
    for path, base in BASES.items():
        for field in base:
            for v in values:
                _check_one(served, path, field, v)


def test_a_fresh_request_is_served_after_the_fuzzing(served):
    r = requests.post(
        served.url + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 3}, timeout=30
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    assert not any(_clean(served).values())
