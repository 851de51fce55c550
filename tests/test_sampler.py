"""Sampler tests: every transform against a plain reference, support sets, seeds, logprobs."""

from __future__ import annotations

import itertools

import pytest
import torch

from pagectl.engine.request import Request
from pagectl.engine.runner import logits_ops
from pagectl.engine.runner.logits_ops import compute_prompt_logprobs
from pagectl.engine.runner.sampler import Sampler, SamplerResult
from pagectl.engine.sampling_params import SamplingParams

_ids = itertools.count()


def make_req(
    prompt: list[int] | None = None,
    output: list[int] = (),
    index: int = 0,
    eos: tuple[int, ...] = (),
    request_id: str | None = None,
    **params,
) -> Request:
    """A request whose all_token_ids is prompt + output (output as if already generated)."""
    params.setdefault("max_tokens", None)
    req = Request(
        request_id or f"r{next(_ids)}",
        list(prompt or [1, 2, 3]),
        SamplingParams(**params),
        eos_token_ids=eos,
        index=index,
    )
    req.all_token_ids.extend(output)
    return req


# -- plain references -------------------------------------------------------------------------


def ref_penalized(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """Bias, min_tokens mask, then repetition / frequency / presence, element by element."""
    sp = req.sampling_params
    x = logits.clone().float()
    for tid, bias in (sp.logit_bias or {}).items():
        x[tid] += bias
    if len(req.all_token_ids) < req.min_num_tokens:
        for tid in req.stop_ids:
            x[tid] = float("-inf")
    output = req.all_token_ids[req.num_prompt_tokens :]
    for tid in set(req.all_token_ids):
        if sp.repetition_penalty != 1.0:
            x[tid] = (
                x[tid] / sp.repetition_penalty if x[tid] > 0 else x[tid] * sp.repetition_penalty
            )
    for tid in set(output):
        x[tid] -= sp.frequency_penalty * output.count(tid)
        x[tid] -= sp.presence_penalty
    return x


def ref_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The textbook pipeline on one row: temperature, top-k, top-p, min-p, as a dict id -> p."""
    p = torch.softmax(logits.double() / temperature, dim=-1).tolist()
    order = sorted(range(len(p)), key=lambda t: -p[t])
    keep = order[:top_k] if top_k > 0 else order
    total = sum(p[t] for t in keep)
    nucleus, mass = [], 0.0
    for t in keep:
        if mass >= top_p:
            break
        nucleus.append(t)
        mass += p[t] / total
    best = p[order[0]]
    final = [t for t in nucleus if p[t] >= min_p * best]
    total = sum(p[t] for t in final)
    return {t: p[t] / total for t in final}


def draw_many(sampler: Sampler, logits_row: torch.Tensor, n: int, **params) -> list[int]:
    """n independent draws: one call with n identical unseeded rows."""
    seqs = [make_req(**params) for _ in range(n)]
    return sampler(logits_row.expand(n, -1).contiguous(), seqs).token_ids


def check_distribution(tokens: list[int], expected: dict[int, float], tol: float) -> None:
    """Nothing outside the support is drawn, everything likely inside it is, at about its
    probability (tokens expected fewer than 10 times may be missing)."""
    counts = torch.bincount(torch.tensor(tokens), minlength=max(tokens) + 1).tolist()
    seen = {t for t, c in enumerate(counts) if c}
    assert seen <= set(expected), f"drawn outside the support: {sorted(seen - set(expected))}"
    likely = {t for t, p in expected.items() if p * len(tokens) >= 10}
    assert likely <= seen, f"never drawn: {sorted(likely - seen)}"
    for t, prob in expected.items():
        assert abs(counts[t] / len(tokens) - prob) < tol, (t, counts[t] / len(tokens), prob)


@pytest.fixture(params=["race", "inverse_cdf"])
def draw(request):
    """Both draw methods: every random-path test runs with each."""
    return request.param


# Distinct logits with well separated probabilities (no near-ties at any cut-off used below).
ROW = torch.tensor([2.0, 0.1, 1.3, -1.0, 0.7, 2.6, -0.4, 1.9, 0.0, -2.0])


# -- greedy -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_and_consumes_no_randomness(dtype):
    logits = torch.randn(9, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    sampler = Sampler(300)
    state = sampler.generator.get_state()
    seqs = [make_req(temperature=0.0, top_k=5, top_p=0.5) for _ in range(9)]
    result = sampler(logits, seqs)
    assert isinstance(result, SamplerResult)
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs is None
    assert torch.equal(sampler.generator.get_state(), state)


def test_greedy_rows_in_a_mixed_batch_take_argmax_of_processed_logits():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    top = int(logits[0].argmax())
    seqs = [
        make_req(temperature=0.0, logit_bias={3: 100.0}),
        make_req(temperature=0.8),
        make_req(temperature=0.0, output=[top], presence_penalty=2.0, frequency_penalty=2.0),
        make_req(temperature=1e-6),
    ]
    logits[2] = logits[0]
    logits[2, top] += 3.0  # still the argmax of the raw row, but not after -4 of penalties
    tokens = Sampler(50)(logits, seqs).token_ids
    assert tokens[0] == 3
    assert int(logits[2].argmax()) == top
    assert tokens[2] == int(ref_penalized(logits[2], seqs[2]).argmax()) != top
    assert tokens[3] == int(logits[3].argmax())


def test_padded_columns_are_never_sampled_nor_counted(draw):
    vocab = 10
    logits = torch.cat([ROW, torch.full((6,), 50.0)]).expand(64, -1).contiguous()
    seqs = [make_req(temperature=0.0, logprobs=2)] + [make_req(temperature=5.0) for _ in range(63)]
    result = Sampler(vocab, draw=draw)(logits, seqs)
    assert max(result.token_ids) < vocab
    assert result.token_ids[0] == 5
    lp = result.logprobs[0]
    assert lp.logprob == pytest.approx(float(torch.log_softmax(ROW, -1)[5]), abs=1e-6)
    assert [t for t, _ in lp.top] == [5, 0]


# -- temperature, top-k, top-p, min-p against the reference -----------------------------------


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.6),
        dict(temperature=2.5),
        dict(temperature=1.0, top_k=3),
        dict(temperature=1.7, top_k=1),
        dict(temperature=1.0, top_k=-1),
        dict(temperature=1.0, top_p=0.7),
        dict(temperature=0.8, top_p=0.95),
        dict(temperature=1.0, top_k=4, top_p=0.8),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=2.0, min_p=0.4),
        dict(temperature=1.5, top_k=6, top_p=0.9, min_p=0.3),
    ],
    ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()),
)
def test_sampling_matches_reference_distribution(params, draw):
    expected = ref_probs(ROW, **params)
    tokens = draw_many(Sampler(10, seed=7, draw=draw), ROW, 6000, **params)
    check_distribution(tokens, expected, tol=0.025)


@pytest.mark.parametrize("candidates", [(1024,), (12,), (1, 8, 24)])
def test_truncated_distribution_equals_reference_exactly_row_by_row(candidates, monkeypatch):
    # 1024 > vocab: one full sort. Smaller: the candidate path, retried wider, then a full sort.
    monkeypatch.setattr(logits_ops, "_TOP_P_CANDIDATES", candidates)
    gen = torch.Generator().manual_seed(3)
    rows = 80
    logits = torch.randn(rows, 64, generator=gen) * 3
    choices = dict(
        temperature=[0.5, 1.0, 1.9],
        top_k=[0, -1, 1, 5, 20, 64, 100],
        top_p=[1.0, 0.99, 0.9, 0.5, 0.05],
        min_p=[0.0, 0.05, 0.3],
    )
    pick = torch.Generator().manual_seed(4)
    params = [
        {k: v[int(torch.randint(len(v), (1,), generator=pick))] for k, v in choices.items()}
        for _ in range(rows)
    ]
    probs = Sampler(64).sampling_probs(logits, [make_req(**p) for p in params])
    for i, p in enumerate(params):
        expected = torch.zeros(64, dtype=torch.float64)
        for t, prob in ref_probs(logits[i], **p).items():
            expected[t] = prob
        torch.testing.assert_close(probs[i].double(), expected, atol=1e-5, rtol=1e-4)
        assert set(probs[i].nonzero().flatten().tolist()) == set(
            expected.nonzero().flatten().tolist()
        )


def test_top_p_keeps_the_token_that_crosses_the_threshold(draw):
    # Probabilities 0.5, 0.3, 0.2: top_p 0.6 needs the second token, 0.5 does not.
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    sampler = Sampler(3, draw=draw)
    assert set(draw_many(sampler, logits, 2000, top_p=0.6)) == {0, 1}
    assert set(draw_many(sampler, logits, 2000, top_p=0.45)) == {0}
    assert set(draw_many(sampler, logits, 2000, top_p=0.85)) == {0, 1, 2}


def test_rows_with_different_truncation_do_not_leak_into_each_other(draw):
    sampler = Sampler(10, seed=1, draw=draw)
    seqs = [make_req(top_k=2), make_req(top_p=0.3), make_req(min_p=0.9), make_req()] * 2000
    tokens = sampler(ROW.expand(len(seqs), -1).contiguous(), seqs).token_ids
    assert set(tokens[0::4]) == {5, 0}
    assert set(tokens[1::4]) == {5}
    assert set(tokens[2::4]) == {5}
    assert set(tokens[3::4]) == set(range(10))


# -- penalties, logit_bias, min_tokens --------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        dict(repetition_penalty=1.25),
        dict(repetition_penalty=0.5),
        dict(frequency_penalty=0.5),
        dict(presence_penalty=-0.75),
        dict(frequency_penalty=1.5, presence_penalty=0.25, repetition_penalty=2.0),
        dict(logit_bias={0: 5.0, 7: -100.0, 39: 0.5}),
        dict(logit_bias={4: 1.0}, repetition_penalty=1.5, presence_penalty=2.0),
    ],
    ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()),
)
def test_processed_logits_equal_reference_exactly(params):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 40, generator=gen) * 4
    seqs = [
        make_req(prompt=[4, 4, 9, 17], output=[9, 30, 30, 30, 2], **params),
        make_req(prompt=[1], output=[], **params),
        make_req(prompt=[2, 3, 39], output=[0, 0, 6], temperature=0.0),  # untouched row
    ]
    processed = Sampler(40).process_logits(logits, seqs)
    for i, seq in enumerate(seqs):
        assert torch.equal(processed[i], ref_penalized(logits[i], seq)), i
    assert torch.equal(processed[2], logits[2])


def test_penalties_with_awkward_values_match_reference_closely():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 100, generator=gen) * 3
    params = dict(repetition_penalty=1.13, frequency_penalty=0.37, presence_penalty=-1.9)
    seqs = [make_req(prompt=list(range(0, 60, 3)), output=[1, 1, 5, 99, 99, 3], **params)] * 2
    processed = Sampler(100).process_logits(logits, seqs)
    for i in range(2):
        torch.testing.assert_close(processed[i], ref_penalized(logits[i], seqs[i]))


def test_presence_and_frequency_ignore_the_prompt_but_repetition_does_not():
    logits = torch.ones(2, 8)
    seqs = [
        make_req(prompt=[1, 2], output=[3], presence_penalty=1.0, frequency_penalty=1.0),
        make_req(prompt=[1, 2], output=[3], repetition_penalty=2.0),
    ]
    processed = Sampler(8).process_logits(logits, seqs)
    assert processed[0].tolist() == [1, 1, 1, -1, 1, 1, 1, 1]
    assert processed[1].tolist() == [1, 0.5, 0.5, 0.5, 1, 1, 1, 1]


def test_process_logits_never_writes_into_the_callers_logits():
    logits = torch.randn(2, 20)
    before = logits.clone()
    seqs = [make_req(logit_bias={1: 3.0}, repetition_penalty=2.0), make_req()]
    sampler = Sampler(20)
    sampler.process_logits(logits, seqs)
    sampler(logits, seqs)
    sampler(logits, [make_req(top_k=2), make_req(top_p=0.5, min_p=0.1)])
    assert torch.equal(logits, before)


def test_min_tokens_masks_eos_and_stop_ids_until_reached(draw):
    vocab = 12
    logits = torch.zeros(vocab)
    logits[11] = 30.0  # eos
    logits[4] = 20.0  # a stop token id
    sampler = Sampler(vocab, draw=draw)
    for temperature in (0.0, 1.0):
        seqs = [
            make_req(
                prompt=[1, 2],
                output=[],
                eos=(11,),
                stop_token_ids=[4],
                min_tokens=3,
                temperature=temperature,
            )
            for _ in range(200)
        ]
        tokens = sampler(logits.expand(200, -1).contiguous(), seqs).token_ids
        assert not {4, 11} & set(tokens)
    # Two tokens out, one to go: still masked. Three out: eos is back.
    almost = make_req(prompt=[1, 2], output=[0, 0], eos=(11,), min_tokens=3, temperature=0.0)
    done = make_req(prompt=[1, 2], output=[0, 0, 0], eos=(11,), min_tokens=3, temperature=0.0)
    assert sampler(logits.expand(2, -1).contiguous(), [almost, done]).token_ids == [4, 11]
    # ignore_eos: eos is no stop id, so min_tokens leaves it alone.
    free = make_req(eos=(11,), min_tokens=5, ignore_eos=True, temperature=0.0)
    assert sampler(logits[None], [free]).token_ids == [11]


def test_penalties_steer_sampling(draw):
    vocab = 6
    logits = torch.zeros(3000, vocab)
    seqs = [make_req(prompt=[0], output=[1, 1, 2], frequency_penalty=2.0) for _ in range(3000)]
    tokens = Sampler(vocab, draw=draw)(logits, seqs).token_ids
    x = torch.tensor([0.0, -4.0, -2.0, 0.0, 0.0, 0.0])
    check_distribution(tokens, dict(enumerate(torch.softmax(x, -1).tolist())), tol=0.02)


# -- seeds ------------------------------------------------------------------------------------


def run_steps(sampler, batches, steps_logits):
    """Feed each step's logits to each batch; append sampled tokens like the engine does."""
    out = []
    for step_logits in steps_logits:
        seqs = batches()
        rows = torch.stack([step_logits[s.request_id] for s in seqs])
        tokens = sampler(rows, seqs).token_ids
        for s, t in zip(seqs, tokens, strict=True):
            s.all_token_ids.append(t)
        out.append(tokens)
    return out


def test_seeded_request_is_independent_of_batch_composition_and_engine_seed(draw):
    vocab = 500
    gen = torch.Generator().manual_seed(8)
    names = ["seeded", "other-seeded", "free-a", "free-b", "greedy"]
    steps = [{n: torch.randn(vocab, generator=gen) for n in names} for _ in range(6)]

    def params(name):
        return {
            "seeded": dict(seed=1234, top_k=200, top_p=0.95),
            "other-seeded": dict(seed=99),
            "greedy": dict(temperature=0.0),
        }.get(name, {})

    alone = make_req(request_id="seeded", **params("seeded"))
    solo = [t[0] for t in run_steps(Sampler(vocab, seed=0, draw=draw), lambda: [alone], steps)]

    crowd = {n: make_req(request_id=n, **params(n)) for n in names}
    orders = itertools.cycle([names, names[::-1], ["free-a", "seeded"], names[2:] + names[:2]])
    seen = []

    def batch():
        order = next(orders)
        seen.append(order.index("seeded"))
        return [crowd[n] for n in order]

    run_steps(Sampler(vocab, seed=42, draw=draw), batch, steps)
    assert crowd["seeded"].output_token_ids == solo
    assert len(set(seen)) > 1  # the request really moved around the batch


def test_children_of_a_seeded_request_differ_and_each_is_reproducible(draw):
    vocab = 1000
    logits = torch.zeros(4, vocab)

    def children():
        return [make_req(request_id="req", index=i, seed=5) for i in range(4)]

    def sample_twice(sampler, seqs):
        return [sampler(logits, seqs).token_ids for _ in range(3)]

    first = sample_twice(Sampler(vocab, draw=draw), children())
    again = sample_twice(Sampler(vocab, seed=3, draw=draw), children()[::-1])
    assert first == [row[::-1] for row in again]
    per_child = list(zip(*first, strict=True))
    assert len(set(per_child)) == 4
    # Each step draws afresh: a child's tokens are not one value repeated.
    assert all(len(set(c)) > 1 for c in per_child)


def test_unseeded_rows_follow_the_engine_seed(draw):
    logits = torch.zeros(8, 1000)

    def sample(seed):
        return Sampler(1000, seed=seed, draw=draw)(logits, [make_req() for _ in range(8)]).token_ids

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_forget_restarts_a_seeded_sequence(draw):
    logits = torch.zeros(1, 1000)
    sampler = Sampler(1000, draw=draw)
    req = make_req(request_id="again", seed=77)
    first = sampler(logits, [req]).token_ids
    second = sampler(logits, [req]).token_ids
    assert first != second
    sampler.forget(["again", "never-seen"])
    assert sampler(logits, [req]).token_ids == first


def _stream_states(sampler: Sampler) -> list[torch.Tensor]:
    """The engine's generator state, then each seeded sequence's, in creation order."""
    gens = [sampler.generator, *sampler._seq_generators.values()]
    return [g.get_state() for g in gens]


def test_drawing_some_rows_advances_every_stream_as_drawing_all(draw):
    vocab = 400
    gen = torch.Generator().manual_seed(14)
    probs = torch.softmax(torch.randn(7, vocab, generator=gen) * 3, dim=-1)
    a, b = make_req(request_id="a", seed=21), make_req(request_id="b", seed=22)
    # Seeded rows of the same sequence next to each other and apart, unseeded rows between.
    seqs = [a, make_req(), a, b, make_req(), a, b]
    wanted = [1, 2, 5]
    # The rows not drawn are never read: garbage there changes nothing.
    junk = probs.clone()
    junk[[0, 3, 4, 6]] = float("nan")
    full, some = Sampler(vocab, seed=3, draw=draw), Sampler(vocab, seed=3, draw=draw)
    for _ in range(3):
        every = full.draw_from(probs, seqs)
        assert some.draw_from(junk, seqs, rows_to_draw=wanted).tolist() == every[wanted].tolist()
        # Every stream is where drawing all rows leaves it, so later draws agree too.
        states = list(zip(_stream_states(full), _stream_states(some), strict=True))
        assert len(states) == 3 and all(torch.equal(x, y) for x, y in states)
    assert some.draw_from(probs, seqs, rows_to_draw=[]).tolist() == []
    full.draw_from(probs, seqs)
    assert all(torch.equal(x, y) for x, y in zip(_stream_states(full), _stream_states(some)))


def test_greedy_tokens_are_the_samplers_greedy_choice():
    vocab = 60
    gen = torch.Generator().manual_seed(15)
    logits = torch.randn(6, vocab + 4, generator=gen) * 2
    logits[:, vocab:] = 50.0  # LM-head padding: never chosen
    top = logits[:, :vocab].argmax(dim=-1).tolist()
    seqs = [
        make_req(temperature=0.0, logprobs=2),
        make_req(temperature=0.0, logit_bias={7: 40.0}),
        make_req(temperature=0.0, output=[top[2]], repetition_penalty=50.0, logprobs=0),
        make_req(temperature=0.0, output=[top[3]] * 3, frequency_penalty=2.0, presence_penalty=2.0),
        make_req(temperature=0.0, output=[1], eos=(top[4],), min_tokens=5),
        make_req(temperature=0.0),
    ]
    sampler = Sampler(vocab)
    state = sampler.generator.get_state()
    tokens = sampler.greedy_tokens(logits, seqs).tolist()
    assert tokens == sampler(logits, seqs).token_ids
    # Every kind of processing moved its row off the raw argmax (so the test can fail).
    assert [t != r for t, r in zip(tokens, top, strict=True)] == [False] + [True] * 4 + [False]
    assert torch.equal(sampler.generator.get_state(), state)
    # Without any processing: the raw argmax, in the logits' own dtype.
    plain = [make_req(temperature=0.0, logprobs=1) for _ in range(6)]
    half = logits.bfloat16()
    assert sampler.greedy_tokens(half, plain).tolist() == sampler(half, plain).token_ids


# -- logprobs ---------------------------------------------------------------------------------


def check_logprobs(entry, raw_row: torch.Tensor, token: int, num: int) -> None:
    ref = torch.log_softmax(raw_row.double(), dim=-1)
    assert entry.logprob == pytest.approx(float(ref[token]), abs=1e-5)
    assert entry.rank == 1 + int((ref > ref[token]).sum())
    order = ref.argsort(descending=True)[:num].tolist()
    assert [t for t, _ in entry.top] == order
    for t, lp in entry.top:
        assert lp == pytest.approx(float(ref[t]), abs=1e-5)


def test_sample_logprobs_come_from_raw_logits(draw):
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 200, generator=gen) * 5
    seqs = [
        make_req(logprobs=3, temperature=0.3, top_k=4, repetition_penalty=1.7, output=[5, 6]),
        make_req(),
        make_req(logprobs=0, temperature=0.0, logit_bias={17: 30.0}),
        make_req(logprobs=20, temperature=3.0, top_p=0.5),
        make_req(logprobs=1, temperature=0.0),
    ]
    result = Sampler(200, draw=draw)(logits, seqs)
    assert result.logprobs[1] is None
    assert result.token_ids[2] == 17
    assert result.logprobs[2].top == []
    for i, num in [(0, 3), (2, 0), (3, 20), (4, 1)]:
        check_logprobs(result.logprobs[i], logits[i], result.token_ids[i], num)
    assert result.logprobs[4].rank == 1
    assert result.logprobs[2].rank > 1


def test_logprobs_of_half_precision_logits_are_computed_in_float32():
    logits = (torch.randn(2, 300, generator=torch.Generator().manual_seed(10)) * 4).bfloat16()
    seqs = [make_req(logprobs=5), make_req(logprobs=5, temperature=0.0)]
    result = Sampler(300)(logits, seqs)
    for i in range(2):
        check_logprobs(result.logprobs[i], logits[i].float(), result.token_ids[i], 5)


def test_prompt_logprobs_match_log_softmax(monkeypatch):
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(13, 70, generator=gen) * 3
    targets = torch.randint(64, (13,), generator=gen)
    # Blocks of 2 positions (140 elements / 70 columns): the blocking must not shift anything.
    monkeypatch.setattr(logits_ops, "_PROMPT_BLOCK_ELEMS", 140)
    entries = compute_prompt_logprobs(logits, targets, 4, vocab_size=64)
    assert len(entries) == 13
    for i, entry in enumerate(entries):
        check_logprobs(entry, logits[i, :64], int(targets[i]), 4)
    unpadded = compute_prompt_logprobs(logits[:, :64].contiguous(), targets, 0)
    assert [e.logprob for e in unpadded] == [e.logprob for e in entries]
    assert all(e.top == [] for e in unpadded)


def test_unknown_draw_method_is_refused():
    with pytest.raises(ValueError, match="draw must be one of"):
        Sampler(10, draw="multinomial")


def test_top_k_still_cuts_when_top_p_is_just_below_one():
    # The renormalised top-k mass rounds to just under 1 - 1e-12: top-k must still bound it.
    logits = torch.randn(200, 50, generator=torch.Generator().manual_seed(13)) * 3
    logits_ops.apply_top_k_top_p(logits, [3] * 200, [1 - 1e-12] * 200)
    assert (logits > float("-inf")).sum(dim=-1).tolist() == [3] * 200
