"""Speculative decoding with a draft model on the real engine.

The draft of each tiny target is its first decoder layer (``truncated_draft``: same
tokenizer). Greedy output equals transformers' token for token (Qwen3, Qwen2, Llama; prefix
caching on and off, chunked prefill at odd budgets, forced preemption, n > 1); the prefix
cache never holds a rejected token; no block leaks; every block the prefix cache holds also
holds the draft's KV of its tokens (compared with transformers' cache of the draft); a draft
with another tokenizer is refused; sampling keeps the target's distribution (rejection
sampling against the draft's probabilities, chi-square on the first tokens).
"""

from __future__ import annotations

import pytest
import torch
from engine_cases import build_tiny_engine
from test_spec_decode import (
    CONFIGS,
    MAX_NEW,
    MIXED_RUN,
    MODELS,
    PROMPTS,
    VOCAB,
    _check_cache_holds_only_verified,
    assert_target_distribution,
    check_no_block_leaks_after_a_mixed_run,
    check_speculated,
)
from tiny_models import build_tiny_model, engine_greedy, lazy_reference_models

from pagectl import SamplingParams
from pagectl.engine.kv.hashing import hash_request_blocks
from pagectl.testing.truncated_draft import write_truncated_draft

K = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (target dir, draft dir, transformers' greedy continuations of PROMPTS)."""
    targets = lazy_reference_models(tmp_path_factory, MODELS, PROMPTS, MAX_NEW, VOCAB)
    drafts: dict[str, object] = {}

    def get(name: str):
        path, reference = targets(name)
        if name not in drafts:
            drafts[name] = write_truncated_draft(path, tmp_path_factory.mktemp(f"{name}_d"), 1)
        return path, drafts[name], reference

    return get


def _spec(draft, k=K):
    return {
        "method": "draft_model",
        "model": str(draft),
        "num_speculative_tokens": k,
        "disable_by_batch_size": 0,
    }


def _engine(path, draft, k=K, **kw):
    return build_tiny_engine(path, spec=_spec(draft, k), **kw)


# CONFIGS and PROMPTS are the n-gram tests'. (Block size 16 with prefix caching and a
# budget without chunking: the ctl-status test.)
CASES = [
    ("qwen3", "no_prefix_cache"),
    ("qwen3", "chunk13_bs8_k8"),
    ("qwen2", "chunk7_bs4"),
    ("llama", "preempt_bs4"),
]


@pytest.mark.parametrize("model_name,config", CASES)
def test_greedy_with_a_draft_model_matches_transformers(models, model_name, config):
    path, draft, reference = models(model_name)
    built = _engine(path, draft, 8 if config.endswith("k8") else K, **CONFIGS[config])
    try:
        out = engine_greedy(built.core, PROMPTS, MAX_NEW)
        for i, (ours, ref) in enumerate(zip(out["tokens"], reference, strict=True)):
            assert ours == ref, f"prompt {i} (length {len(PROMPTS[i])})"
        check_speculated(built, config)
        assert built.core.scheduler.counters.generation_tokens == MAX_NEW * len(PROMPTS)
    finally:
        built.shutdown()


def test_parallel_samples_with_a_draft_model(models):
    path, draft, reference = models("qwen3")
    built = _engine(path, draft, block_size=4)
    core = built.core
    try:
        sp = SamplingParams(n=3, temperature=0.0, ignore_eos=True, max_tokens=MAX_NEW)
        # A prompt whose proposals are sometimes accepted, sometimes not.
        core.add_request("p", PROMPTS[4], sp)
        got: dict[int, list[int]] = {0: [], 1: [], 2: []}
        while core.has_unfinished():
            for o in core.step():
                got[o.index].extend(o.new_token_ids)
        assert got[0] == got[1] == got[2] == reference[4]
        c = core.scheduler.counters
        assert 0 < c.spec_decode_num_accepted_tokens < c.spec_decode_num_draft_tokens
        assert core.scheduler.kv.pool.num_used_blocks == 0
    finally:
        built.shutdown()


def _draft_kv_reference(draft, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """transformers' cache of the draft over ``tokens``: per layer (K, V) ``[len, heads, dim]``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(draft), dtype=torch.float32).eval()
    with torch.no_grad():
        cache = hf(torch.tensor([tokens]), use_cache=True).past_key_values
    return [
        (layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in cache.layers
    ]


def test_prefix_cache_blocks_hold_the_drafts_kv_and_no_rejected_token(models):
    """After a run with prefix-cache hits, chunked prefill and rejections: every cached
    block's hash is a block of a real sequence, and the draft's KV in it equals the draft's
    KV of that sequence computed from scratch (so a later hit gives the draft what it needs,
    including positions filled by fully accepted runs)."""
    path, draft, reference = models("qwen3")
    bs = 4
    built = _engine(path, draft, block_size=bs, max_num_batched_tokens=11)
    core = built.core
    try:
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_NEW)
        for i, p in enumerate(PROMPTS):
            core.add_request(f"r{i}", p, sp)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        saw_rejection = saw_full_accept = False
        sched = core.scheduler
        while core.has_unfinished():
            c = sched.counters
            before, acc = c.spec_decode_num_draft_tokens, c.spec_decode_num_accepted_tokens
            drafts = c.spec_decode_num_drafts
            per_last = list(c.spec_decode_num_accepted_tokens_per_pos[K - 1 : K])
            for o in core.step():
                tokens[o.request_id].extend(o.new_token_ids)
            if c.spec_decode_num_draft_tokens - before > c.spec_decode_num_accepted_tokens - acc:
                saw_rejection = True
            if c.spec_decode_num_drafts > drafts and list(
                c.spec_decode_num_accepted_tokens_per_pos[K - 1 : K]
            ) != (per_last or [0]):
                saw_full_accept = True
            _check_cache_holds_only_verified(core)
        assert saw_rejection and saw_full_accept
        assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == reference
        where: dict[bytes, tuple[list[int], int]] = {}
        for i, p in enumerate(PROMPTS):
            seq = p + tokens[f"r{i}"]
            for b, h in enumerate(hash_request_blocks(seq, bs, [])):
                where[h] = (seq, b)
        cached = sched.kv.pool.cached_blocks
        assert len(cached) > 20 and set(cached) <= set(where)
        pool = core.executor.drafter.runner.kv.tensor  # [layers, 2, blocks + 1, bs, heads, dim]
        refs: dict[int, list] = {}
        for h, block in cached.items():
            seq, b = where[h]
            key = id(seq)
            if key not in refs:
                refs[key] = _draft_kv_reference(draft, seq[: len(seq) - 1])
            for layer, (k_ref, v_ref) in enumerate(refs[key]):
                span = slice(b * bs, (b + 1) * bs)
                torch.testing.assert_close(pool[layer, 0, block.block_id], k_ref[span])
                torch.testing.assert_close(pool[layer, 1, block.block_id], v_ref[span])
    finally:
        built.shutdown()


def test_no_block_leaks_after_a_mixed_run(models):
    path, draft, _ = models("llama")
    built = _engine(path, draft, **MIXED_RUN)
    kinds = [
        SamplingParams(temperature=0, ignore_eos=True, max_tokens=20),
        SamplingParams(temperature=0.8, seed=3, max_tokens=20, n=2),
        SamplingParams(temperature=1.0, top_k=5, ignore_eos=True, max_tokens=15),
        SamplingParams(
            temperature=0.7, repetition_penalty=1.3, ignore_eos=True, max_tokens=15, logprobs=2
        ),
    ]

    def check_logprobs(o) -> None:
        if o.new_logprobs is not None:
            assert len(o.new_logprobs) == len(o.new_token_ids)

    try:
        check_no_block_leaks_after_a_mixed_run(built.core, kinds, check_logprobs)
    finally:
        built.shutdown()


def test_a_draft_with_another_tokenizer_is_refused(models, tmp_path):
    path, _, _ = models("qwen3")
    other = build_tiny_model(tmp_path / "other", "qwen3", vocab_size=320)
    with pytest.raises(ValueError, match="must share the target's tokenizer.*vocabularies differ"):
        _engine(path, other)
    bare = build_tiny_model(tmp_path / "bare", "qwen3", vocab_size=VOCAB, with_tokenizer=False)
    with pytest.raises(ValueError, match="the draft model has no tokenizer"):
        _engine(path, bare)
    with pytest.raises(ValueError, match="speculative_config.model"):
        _engine(path, tmp_path / "missing")


def test_ctl_status_shows_the_draft_model(models):
    from pagectl.cli.ctl import format_status

    path, draft, _ = models("qwen3")
    built = _engine(path, draft)
    try:
        engine_greedy(built.core, PROMPTS[-2:], 8)
        text = format_status(built.core.status())
        assert f"spec      draft_model ({draft}) num_speculative_tokens={K}" in text
        # A block costs its bytes in both pools (the draft: 1 layer of 2 KV heads x 32).
        target = 2 * 2 * 16 * 2 * 32 * 4
        assert built.core.model_info.kv_bytes_per_block == target + target // 2
    finally:
        built.shutdown()


# -- the sampled distribution ---------------------------------------------------------------

NUM_SAMPLES = 800


def _check_distribution(models, num_samples: int) -> None:
    path, draft, reference = models("qwen3")
    prompt = PROMPTS[-2] + reference[-2]
    assert_target_distribution(path, prompt, num_samples, _spec(draft, 2))


def test_sampled_distribution_is_the_targets(models):
    _check_distribution(models, NUM_SAMPLES)


@pytest.mark.extended
def test_sampled_distribution_is_the_targets_many_samples(models):
    _check_distribution(models, 20000)


def test_rejection_sampling_keeps_the_target_distribution():
    """Explicit p and q over 4 tokens: proposals drawn from q, then verified, give p; a
    proposal p cannot produce is never emitted; rows without a proposal draw from p."""
    from pagectl.engine.request import Request
    from pagectl.engine.runner.sampler import Sampler
    from pagectl.engine.spec_decode.rejection import rejection_sample

    n = 20000
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.6, 0.1, 0.2])
    g = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    req = Request("a", [1], SamplingParams(temperature=1.0), max_model_len=64)
    sampler = Sampler(4, seed=1)
    logits = p.log().expand(2 * n, 4).contiguous()
    rows = [req] * (2 * n)
    # Even rows check a proposal, odd rows have none.
    result = rejection_sample(
        sampler, logits, rows, list(range(0, 2 * n, 2)), drafts, q.expand(n, 4).contiguous()
    )
    checked = torch.tensor(result.token_ids[0::2])
    free = torch.tensor(result.token_ids[1::2])
    for got in (checked, free):
        counts = torch.bincount(got, minlength=4).double()
        assert counts[3] == 0
        expected = n * p[:3].double()
        stat = float(((counts[:3] - expected) ** 2 / expected).sum())
        assert stat < 13.8  # chi-square, 2 degrees of freedom, p = 0.001
    # Accepted where the proposal was kept: at most min(1, p/q) of each proposal.
    kept = sum(1 for d, t in zip(drafts, result.token_ids[0::2], strict=True) if d == t)
    assert abs(kept / n - float(torch.minimum(p, q).sum())) < 0.02
    # The test can fail: emitting the proposals as they are gives q, far from p.
    as_drafted = torch.bincount(torch.tensor(drafts), minlength=4).double()
    assert float(((as_drafted[:3] - expected) ** 2 / expected).sum()) > 1000


# -- unchanged output: the draws and proposals as first written -------------------------------


def _rejection_sample_drawing_every_row(sampler, logits, rows, draft_rows, draft_tokens, q):
    """``rejection_sample`` as first written: every row drawn from p, then the rows that check
    a proposal overwritten. The reference whose tokens (and random streams) it must keep."""
    from pagectl.engine.runner.sampler import SamplerResult
    from pagectl.engine.spec_decode.rejection import check_proposals

    p = sampler.sampling_probs(logits, rows)
    tokens = sampler.draw_from(p, rows)
    if draft_rows:
        tokens.index_copy_(0, *check_proposals(sampler, p, rows, draft_rows, draft_tokens, q))
    return SamplerResult(tokens.tolist(), sampler.logprobs_of(logits, tokens, rows))


def _greedy_tokens_of_the_whole_sampler(self, logits, seqs):
    """The draft's greedy proposals as first written: the whole sampler, logprobs included."""
    return torch.tensor(self(logits, seqs).token_ids)


def _stream_states(sampler) -> list[torch.Tensor]:
    return [g.get_state() for g in (sampler.generator, *sampler._seq_generators.values())]


@pytest.mark.parametrize("draw", ["race", "inverse_cdf"])
def test_rejection_sampling_keeps_the_tokens_of_drawing_every_row(draw):
    """Rows that check a proposal are no longer drawn from p first, yet seeded, unseeded and
    greedy rows get the tokens, and leave the random streams, of drawing every row."""
    from pagectl.engine.request import Request
    from pagectl.engine.runner.sampler import Sampler
    from pagectl.engine.spec_decode.rejection import rejection_sample

    vocab = 300
    gen = torch.Generator().manual_seed(4)
    params = [
        SamplingParams(temperature=0.9, seed=7),
        SamplingParams(temperature=1.0, top_k=50),
        SamplingParams(temperature=0.8, seed=8, top_p=0.9),
        SamplingParams(temperature=1.2),
        SamplingParams(temperature=0.0),
    ]
    reqs = [Request(f"s{i}", [1, 2], sp, max_model_len=64) for i, sp in enumerate(params)]
    num_proposals = [0, 3, 2, 1, 2]
    rows: list = []
    draft_rows: list[int] = []
    for req, k in zip(reqs, num_proposals, strict=True):
        draft_rows.extend(range(len(rows), len(rows) + k))
        rows.extend([req] * (k + 1))
    logits = torch.randn(len(rows), vocab, generator=gen) * 2
    q = torch.softmax(torch.randn(len(draft_rows), vocab, generator=gen) * 2, dim=-1)
    drafts = torch.multinomial(q, 1, generator=gen)[:, 0].tolist()
    # The greedy sequence's proposals: one-hot q, the first its target's argmax, then not.
    greedy = [t for t, r in enumerate(draft_rows) if rows[r] is reqs[4]]
    drafts[greedy[0]] = int(logits[draft_rows[greedy[0]]].argmax())
    drafts[greedy[1]] = int(logits[draft_rows[greedy[1]]].argmin())
    for t in greedy:
        q[t] = torch.nn.functional.one_hot(torch.tensor(drafts[t]), vocab).float()
    ours, ref = Sampler(vocab, seed=5, draw=draw), Sampler(vocab, seed=5, draw=draw)
    kept = 0
    for _ in range(5):
        got = rejection_sample(ours, logits, rows, draft_rows, drafts, q)
        want = _rejection_sample_drawing_every_row(ref, logits, rows, draft_rows, drafts, q)
        assert got.token_ids == want.token_ids
        mine, theirs = _stream_states(ours), _stream_states(ref)
        assert len(mine) == 3 and all(map(torch.equal, mine, theirs))
        kept += sum(got.token_ids[r] == drafts[t] for t, r in enumerate(draft_rows))
    # Both outcomes happened (rejected rows emit residual draws), and the draws vary.
    assert 0 < kept < 5 * len(draft_rows)


def _params(**kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=16, **kw)


def _run_requests(built, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    core = built.core
    for rid, (prompt, sp) in requests.items():
        core.add_request(rid, prompt, sp)
    tokens: dict[tuple[str, int], list[int]] = {}
    while core.has_unfinished():
        for o in core.step():
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    c = core.scheduler.counters
    counts = (
        c.spec_decode_num_drafts,
        c.spec_decode_num_draft_tokens,
        list(c.spec_decode_num_accepted_tokens_per_pos),
    )
    return {"tokens": tokens, "counts": counts}


@pytest.mark.parametrize("draw", ["inverse_cdf", "race"])
def test_seeded_sampling_with_a_draft_model_keeps_its_tokens(models, monkeypatch, draw):
    """Seeded and unseeded sampled requests (beside greedy ones) give, token for token, what
    the rejection sampling that drew every row gave (engine seed fixed)."""
    from pagectl.engine.spec_decode import draft_model

    path, draft, _ = models("qwen3")
    requests = {
        "seeded": (PROMPTS[0], _params(temperature=0.8, seed=3, n=2)),
        "seeded_top_k": (PROMPTS[4], _params(temperature=1.0, seed=9, top_k=20)),
        "unseeded": (PROMPTS[2], _params(temperature=0.7)),
        "greedy": (PROMPTS[3], _params(temperature=0.0, logprobs=1)),
    }

    def run() -> dict:
        built = _engine(path, draft, block_size=4, seed=5)
        built.core.executor.sampler.draw = draw
        built.core.executor.drafter.sampler.draw = draw
        try:
            return _run_requests(built, requests)
        finally:
            built.shutdown()

    ours = run()
    monkeypatch.setattr(draft_model, "rejection_sample", _rejection_sample_drawing_every_row)
    assert run() == ours
    _, num_draft_tokens, accepted = ours["counts"]
    assert 0 < sum(accepted) < num_draft_tokens


def test_greedy_drafts_with_processing_propose_the_samplers_choice(models, monkeypatch):
    """Greedy drafts take the argmax without the whole sampler, but through the same logits
    processing: penalties, logit_bias and min_tokens move the proposals (a raw argmax would
    propose otherwise), and logprobs are asked for; proposals, acceptance and output are those
    of the whole sampler, and the output is plain decoding's."""
    from pagectl.engine.runner.sampler import Sampler

    path, draft, _ = models("qwen3")
    requests = {
        "repetition": (PROMPTS[4], _params(temperature=0.0, repetition_penalty=1.5)),
        "bias": (PROMPTS[3], _params(temperature=0.0, logit_bias={5: 4.0, 9: 3.5}, logprobs=2)),
        "presence": (PROMPTS[1], _params(temperature=0.0, presence_penalty=1.5)),
        "min_tokens": (PROMPTS[0], _params(temperature=0.0, min_tokens=12, ignore_eos=False)),
        "plain": (PROMPTS[2], _params(temperature=0.0, logprobs=1)),
    }

    def run(spec: bool = True) -> dict:
        if spec:
            built = _engine(path, draft, block_size=4)
        else:
            built = build_tiny_engine(path, block_size=4)
        try:
            if spec:
                # Only the proposer samples for the draft; the target keeps its own sampler.
                assert built.core.executor.drafter.runner.sampler is None
                assert built.core.executor.sampler.stream == 0
            return _run_requests(built, requests)
        finally:
            built.shutdown()

    ours = run()
    assert ours["tokens"] == run(spec=False)["tokens"]
    monkeypatch.setattr(Sampler, "greedy_tokens", _greedy_tokens_of_the_whole_sampler)
    assert run() == ours
    # The comparison can fail: proposals that skip the processing are accepted otherwise.
    monkeypatch.setattr(Sampler, "greedy_tokens", lambda self, x, seqs: x.argmax(dim=-1))
    assert run()["counts"] != ours["counts"]
