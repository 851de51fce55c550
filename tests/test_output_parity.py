"""The offline LLM and the HTTP server give the same results for the same requests: both
turn engine outputs into text through the one ``OutputProcessor`` (same texts, token ids,
finish reasons, stop reasons and usage, cached tokens included)."""

from __future__ import annotations

import pytest

import pagectl.engine.builder as builder
import pagectl.server.openai_api as openai_api
from pagectl.engine.llm import LLM
from pagectl.engine.sampling_params import SamplingParams
from pagectl.testing.fake_engine import fake_engine

ENGINE_KW = {"num_kv_blocks": 64, "max_num_batched_tokens": 64, "max_model_len": 256}
PROMPT_A = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
PROMPT_B = [40, 41, 42]


@pytest.fixture
def offline(monkeypatch, tok_dir):
    """Makes LLMs over the same fake engine as the HTTP tests' in-process engine."""
    monkeypatch.setattr(builder, "build_engine", fake_engine)
    made: list[LLM] = []

    def make() -> LLM:
        made.append(LLM(model=str(tok_dir), **ENGINE_KW))
        return made[-1]

    yield make
    for llm in made:
        llm.shutdown()


@pytest.fixture
def generations(monkeypatch):
    """Every ``Generation`` the HTTP server builds, to read the token ids it produced."""
    made = []

    class Recorded(openai_api.Generation):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(openai_api, "Generation", Recorded)
    return made


def _cases(stop: str) -> list[dict]:
    """(HTTP body, SamplingParams) pairs, run in this order on a fresh engine each side: the
    repeats hit the prefix cache, so cached-token counts are compared too."""
    return [
        {"prompt": [PROMPT_A], "max_tokens": 12},
        {"prompt": [PROMPT_A], "max_tokens": 12, "stop": [stop]},
        {"prompt": [PROMPT_A, PROMPT_B], "max_tokens": 6, "n": 2},
        {"prompt": [PROMPT_B], "max_tokens": 9, "logprobs": 2},
        {"prompt": [PROMPT_A], "max_tokens": 12},
    ]


def _params(body: dict) -> SamplingParams:
    return SamplingParams(
        max_tokens=body["max_tokens"],
        n=body.get("n", 1),
        stop=body.get("stop", []),
        logprobs=body.get("logprobs"),
        temperature=0.0,
    )


async def test_llm_and_http_give_the_same_outputs(make_client, offline, generations):
    # A stop string that really occurs in the first request's text (so "stop" is exercised).
    first = offline().generate([PROMPT_A], SamplingParams(max_tokens=12, temperature=0.0))
    full_text = first[0].outputs[0].text
    assert len(full_text) > 8
    stop = full_text[4:7]

    llm = offline()  # a fresh engine: an empty prefix cache, as the server's
    client, _ = await make_client(**ENGINE_KW)
    seen_reasons = set()
    for body in _cases(stop):
        outs = llm.generate(body["prompt"], _params(body))
        resp = await client.post("/v1/completions", json={**body, "temperature": 0.0})
        assert resp.status == 200, await resp.text()
        data = await resp.json()
        gen = generations[-1]
        n = body.get("n", 1)
        choices = sorted(data["choices"], key=lambda c: c["index"])
        assert len(choices) == len(outs) * n
        for p, ro in enumerate(outs):
            for i, co in enumerate(ro.outputs):
                ch = choices[p * n + i]
                assert ch["text"] == co.text
                assert ch["finish_reason"] == co.finish_reason
                assert ch["stop_reason"] == co.stop_reason
                assert gen.choices[p * n + i].token_ids == co.token_ids
                if body.get("logprobs"):
                    lps = ch["logprobs"]["token_logprobs"]
                    assert lps == [lp.logprob for lp in co.logprobs or []]
                seen_reasons.add(co.finish_reason)
        usage = data["usage"]
        assert usage["prompt_tokens"] == sum(len(ro.prompt_token_ids) for ro in outs)
        assert usage["completion_tokens"] == sum(
            len(co.token_ids) for ro in outs for co in ro.outputs
        )
        assert usage["prompt_tokens_details"]["cached_tokens"] == sum(
            ro.num_cached_tokens for ro in outs
        )
    assert seen_reasons == {"stop", "length"}
    # The repeated prompt was served from the prefix cache on both sides.
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
