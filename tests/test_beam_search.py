"""Beam search in the engine against transformers' ``generate(num_beams=W)``, float32.

All W sequences equal transformers' when no beam ends early (EOS ignored), and the top one
(in practice all) when beams end on EOS; with prefix caching on and off, under forced
preemption, for W = 2 and 4 and several prompts searched together. Forked beams share
blocks: the peak block count is printed against W independent copies of the sequence.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model

from pagectl import LLM, BeamSearchParams, SamplingParams

MAX_NEW = 12
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 50, 7, 3, 3, 9, 11], list(range(30, 60))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (model dir, transformers model), built on first use."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            path = build_tiny_model(tmp_path_factory.mktemp(name), name, seed=4)
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
            cache[name] = (path, hf)
        return cache[name]

    return get


_HF_CACHE: dict[tuple, list[list[int]]] = {}


def hf_beams(hf, prompt, w, eos, **kw):
    """transformers' W sequences, best first (cached: the same reference serves every
    engine configuration)."""
    key = (id(hf), tuple(prompt), w, eos, tuple(sorted(kw.items())))
    if key in _HF_CACHE:
        return _HF_CACHE[key]
    hf.generation_config.eos_token_id = eos
    ids = torch.tensor([prompt])
    with torch.no_grad():
        g = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW,
            num_beams=w,
            num_return_sequences=w,
            do_sample=False,
            pad_token_id=eos if eos is not None else 0,
            **kw,
        )
    out = []
    for seq in g[:, len(prompt) :].tolist():
        if eos is not None and eos in seq:
            seq = seq[: seq.index(eos) + 1]  # the rest is padding
        out.append(seq)
    _HF_CACHE[key] = out
    return out


def run_beams(llm, prompts, params):
    """Beam search with the engine stepped here; returns (results, peak blocks in use)."""
    core = llm.core
    pool = core.scheduler.kv.pool
    pool.peak_used_blocks = 0
    for i, p in enumerate(prompts):
        core.add_beam_request(f"b{i}", p, params)
    found: dict[str, dict[int, list[int]]] = {f"b{i}": {} for i in range(len(prompts))}
    while core.has_unfinished():
        for o in core.step():
            found[o.request_id][o.index] = list(o.new_token_ids)
    peak = pool.peak_used_blocks
    assert pool.num_used_blocks == 0 and not core.scheduler.beam_groups
    assert not core.scheduler.groups
    return [[found[f"b{i}"][j] for j in sorted(found[f"b{i}"])] for i in range(len(prompts))], peak


CONFIGS = {
    "default": dict(block_size=4, num_kv_blocks=256),
    "no_prefix_cache": dict(block_size=4, num_kv_blocks=256, enable_prefix_caching=False),
    # The 30-token prompt alone needs 11 blocks; its 4 beams (sharing it) and the other
    # prompts' beams do not fit 22 blocks together.
    "preempt": dict(block_size=4, num_kv_blocks=22, max_num_batched_tokens=32),
}


CASES = [
    ("qwen3", "default", 2),
    ("qwen3", "default", 4),
    ("qwen3", "no_prefix_cache", 4),
    ("qwen3", "preempt", 4),
    ("llama", "default", 2),
    ("llama", "preempt", 4),
]


@pytest.mark.parametrize("name,config,w", CASES)
def test_beams_match_transformers_without_eos(models, name, config, w):
    path, hf = models(name)
    llm = LLM(str(path), dtype="float32", **CONFIGS[config])
    try:
        got, _ = run_beams(
            llm, PROMPTS, BeamSearchParams(beam_width=w, max_tokens=MAX_NEW, ignore_eos=True)
        )
        if config == "preempt" and w == 4:
            assert llm.core.scheduler.counters.preemptions > 0
    finally:
        llm.shutdown()
    for p, ours in zip(PROMPTS, got, strict=True):
        assert ours == hf_beams(hf, p, w, None)


@pytest.mark.parametrize(
    "kw",
    [
        dict(length_penalty=1.0),
        dict(length_penalty=0.5),
        dict(length_penalty=1.0, early_stopping=True),
        dict(length_penalty=2.0, early_stopping="never"),
    ],
)
def test_beams_match_transformers_with_eos(models, kw):
    """EOS is made a token that some returned beams end on."""
    path, hf = models("qwen3")
    w = 4
    prompt = PROMPTS[1]
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=256)
    try:
        free, _ = run_beams(
            llm, [prompt], BeamSearchParams(beam_width=w, max_tokens=MAX_NEW, ignore_eos=True)
        )
        # Tokens near the end of the lower beams: as EOS they end a beam that still ranks.
        beams = free[0]
        tails = [b[i] for i in range(MAX_NEW - 1, 0, -1) for b in beams[1:]]
        for eos in dict.fromkeys(t for t in tails if t not in beams[0]):
            ref = hf_beams(hf, prompt, w, eos, **kw)
            if any(eos in seq for seq in ref):
                break
        else:
            raise AssertionError("no token of the best beams ends a returned sequence")
        llm.core.eos_token_ids = (eos,)
        got, _ = run_beams(llm, [prompt], BeamSearchParams(beam_width=w, max_tokens=MAX_NEW, **kw))
        assert got[0][0] == ref[0]
        assert got[0] == ref
    finally:
        llm.shutdown()


def test_beam_search_api_and_block_sharing(models, capsys):
    path, hf = models("qwen3")
    w = 4
    prompt = list(range(30, 60))
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=256)
    try:
        out = llm.beam_search(
            [{"prompt_token_ids": prompt}, "def add(a, b):"],
            BeamSearchParams(beam_width=w, max_tokens=MAX_NEW, ignore_eos=True),
        )
        seqs = out[0].sequences
        assert [s.tokens[len(prompt) :] for s in seqs] == hf_beams(hf, prompt, w, None)
        assert [s.cum_logprob for s in seqs] == sorted((s.cum_logprob for s in seqs), reverse=True)
        # cum_logprob is the sum of the model's log-probabilities of the generated tokens.
        with torch.no_grad():
            logits = hf(torch.tensor([seqs[0].tokens])).logits[0].float()
        lps = torch.log_softmax(logits, -1)
        ref_cum = sum(
            lps[i - 1, seqs[0].tokens[i]].item() for i in range(len(prompt), len(seqs[0].tokens))
        )
        assert seqs[0].cum_logprob == pytest.approx(ref_cum, abs=1e-3)
        tok = llm.get_tokenizer()
        assert out[1].sequences[0].text == tok.decode(out[1].sequences[0].tokens)
        # Peak blocks: W beams sharing their prompt's blocks against W independent copies.
        _, beam_peak = run_beams(
            llm, [prompt], BeamSearchParams(beam_width=w, max_tokens=MAX_NEW, ignore_eos=True)
        )
        llm.core.scheduler.set("enable_prefix_caching", False)
        sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=MAX_NEW)
        core = llm.core
        core.scheduler.kv.pool.peak_used_blocks = 0
        for i in range(w):
            core.add_request(f"copy{i}", prompt, sp)
        while core.has_unfinished():
            core.step()
        copies_peak = core.scheduler.kv.pool.peak_used_blocks
        with capsys.disabled():
            print(
                f"\npeak KV blocks, W={w}, {len(prompt)}-token prompt, {MAX_NEW} new tokens, "
                f"block_size 4: beam search {beam_peak}, {w} independent copies {copies_peak} "
                f"({1 - beam_peak / copies_peak:.0%} fewer)"
            )
        assert beam_peak < copies_peak
    finally:
        llm.shutdown()


def test_abort_and_errors_leave_nothing_behind(models):
    path, _ = models("qwen3")
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=64, max_num_seqs=8)
    core = llm.core
    try:
        core.add_beam_request("a", PROMPTS[2], BeamSearchParams(beam_width=4, max_tokens=MAX_NEW))
        for _ in range(4):
            core.step()
        assert len(core.scheduler.groups["a"]) == 4
        assert core.abort_request("a")
        assert core.scheduler.kv.pool.num_used_blocks == 0
        assert not core.scheduler.beam_groups and not core.scheduler.groups
        # A beam that can never fit ends its whole search with an error.
        sched = core.scheduler
        core.add_beam_request("c", PROMPTS[2], BeamSearchParams(beam_width=4, max_tokens=MAX_NEW))
        for _ in range(4):
            core.step()
        sched._finish_unfittable(sched.groups["c"][1])
        (out,) = sched.take_pending_outputs()
        assert out.finish_reason == "error" and "KV" in out.error
        assert not sched.beam_groups and not sched.groups and not sched._beam_of
        assert sched.kv.pool.num_used_blocks == 0 and not sched.running
        with pytest.raises(ValueError, match="max_num_seqs"):
            core.add_beam_request("b", [1, 2], BeamSearchParams(beam_width=9, max_tokens=4))
        with pytest.raises(ValueError, match="temperature"):
            BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5)
        with pytest.raises(ValueError, match="beam_width"):
            BeamSearchParams(beam_width=0, max_tokens=4)
    finally:
        llm.shutdown()


# -- the HTTP API -------------------------------------------------------------------------


async def test_http_beam_search_completions_and_chat(make_client):
    client, engine = await make_client()
    body = {"prompt": list(range(100, 120)), "max_tokens": 6, "n": 3, "use_beam_search": True}
    resp = await client.post("/v1/completions", json=dict(body, length_penalty=0.8))
    assert resp.status == 200, await resp.text()
    got = await resp.json()
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert got["usage"]["completion_tokens"] <= 3 * 6
    # The same search run on the engine directly gives the same texts.
    core = engine.core
    core.add_beam_request(
        "direct",
        list(range(100, 120)),
        BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.8),
    )
    direct: dict[int, list[int]] = {}
    while core.has_unfinished():
        for o in core.step():
            direct[o.index] = o.new_token_ids
    tok = engine.built.tokenizer
    assert [c["text"] for c in got["choices"]] == [
        tok.decode(direct[j], skip_special_tokens=True) for j in range(3)
    ]
    chat = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "n": 2,
            "use_beam_search": True,
            "early_stopping": True,
        },
    )
    assert chat.status == 200, await chat.text()
    assert len((await chat.json())["choices"]) == 2
    assert core.scheduler.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"stream": True}, "stream"),
        ({"temperature": 0.7}, "temperature"),
        ({"logprobs": 2}, "logprobs"),
        ({"stop": ["x"]}, "stop"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        # 2W candidates per beam come from the top logprobs (at most 20).
        ({"n": 11}, "n"),
        # len ** 1e308 overflows: refused before it reaches the engine's ranking.
        ({"length_penalty": 1e308}, "length_penalty"),
        ({"use_beam_search": False, "length_penalty": 0.5}, "length_penalty"),
        ({"use_beam_search": False, "early_stopping": True}, "early_stopping"),
    ],
)
async def test_http_beam_search_refusals(make_client, extra, param):
    client, _ = await make_client()
    body = {"prompt": "hello", "max_tokens": 4, "n": 2, "use_beam_search": True}
    resp = await client.post("/v1/completions", json=dict(body, **extra))
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == param
