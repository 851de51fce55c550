"""The offline API end to end on a tiny Qwen3: prompt forms, logprobs, penalties, logit_bias,
min_tokens and stop strings against plain reference implementations on transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tiny_models import build_tiny_model

from pagectl import LLM, SamplingParams

MAX_NEW = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llm") / "qwen3", "qwen3", seed=3)


@pytest.fixture(scope="module")
def llm(model_dir):
    engine = LLM(str(model_dir), dtype="float32", num_kv_blocks=256, block_size=8)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def assert_engine_idle(llm: LLM) -> None:
    sched = llm.core.scheduler
    assert not sched.groups and sched.num_running == 0 and sched.num_waiting == 0
    assert sched.kv.pool.num_used_blocks == 0


def test_prompt_forms_and_order(llm):
    tok = llm.get_tokenizer()
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids = tok("def add(a, b):").input_ids
    outs = llm.generate(
        ["def add(a, b):", {"prompt": "Hello world"}, {"prompt_token_ids": ids}, ids], sp
    )
    assert [o.prompt for o in outs] == ["def add(a, b):", "Hello world", None, None]
    assert outs[0].prompt_token_ids == ids == outs[2].prompt_token_ids == outs[3].prompt_token_ids
    assert (
        outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids == outs[3].outputs[0].token_ids
    )
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert outs[0].outputs[0].text == tok.decode(outs[0].outputs[0].token_ids)
    single = llm.generate("Hello world", sp)
    assert single[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert_engine_idle(llm)


def test_detokenize_off_gives_the_same_tokens_and_no_text(llm):
    prompt = {"prompt_token_ids": [5, 17, 99, 3, 250, 41]}
    on = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    off = llm.generate(
        prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, detokenize=False)
    )[0]
    assert off.outputs[0].token_ids == on.outputs[0].token_ids
    assert len(off.outputs[0].token_ids) == 6
    assert on.outputs[0].text and off.outputs[0].text == ""
    with pytest.raises(ValueError, match="detokenize=False"):
        SamplingParams(stop=["\n"], detokenize=False)
    with pytest.raises(ValueError, match="detokenize must be a boolean"):
        SamplingParams(detokenize="no")
    assert_engine_idle(llm)


def test_generated_logprobs_match_transformers(llm, hf):
    prompt = [5, 17, 99, 3, 250, 41]
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3),
    )[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 6
    ref = torch.log_softmax(hf_logits(hf, prompt + c.token_ids[:-1]), dim=-1)
    for i, (tokid, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(lp.logprob - row[tokid].item()) < 1e-4
        assert lp.rank == 1  # greedy picks the most likely token
        top = torch.topk(row, 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        for (_, v), r in zip(lp.top, top.values.tolist()):
            assert abs(v - r) < 1e-4


def reference_processed(
    logits: torch.Tensor, prompt: list[int], output: list[int], sp: SamplingParams
) -> torch.Tensor:
    """Penalties and bias the plain way, one token at a time (OpenAI / HF semantics)."""
    x = logits.clone()
    for t, b in (sp.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt + output):
        if x[t] > 0:
            x[t] /= sp.repetition_penalty
        else:
            x[t] *= sp.repetition_penalty
    for t in set(output):
        x[t] -= sp.frequency_penalty * output.count(t) + sp.presence_penalty
    return x


@pytest.mark.parametrize(
    "kw",
    [
        dict(repetition_penalty=1.7),
        dict(presence_penalty=1.5, frequency_penalty=0.8),
        dict(logit_bias={7: 4.0, 11: -100.0}),
        dict(repetition_penalty=1.3, frequency_penalty=1.1, logit_bias={42: 2.5}),
    ],
)
def test_penalties_and_bias_match_reference_greedy(llm, hf, kw):
    prompt = [9, 9, 12, 13, 9, 14, 15, 12]
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, **kw)
    got = llm.generate({"prompt_token_ids": prompt}, sp)[0].outputs[0].token_ids
    out: list[int] = []
    for _ in range(MAX_NEW):
        logits = hf_logits(hf, prompt + out)[-1]
        out.append(int(reference_processed(logits, prompt, out, sp).argmax()))
    assert got == out
    plain = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
    )
    assert plain[0].outputs[0].token_ids != got  # the processing changed something


def test_min_tokens_holds_back_eos(llm):
    eos = llm.engine.eos_token_ids[0]
    prompt = {"prompt_token_ids": [20, 21, 22]}
    eager = SamplingParams(max_tokens=10, temperature=0, logit_bias={eos: 100.0})
    assert llm.generate(prompt, eager)[0].outputs[0].token_ids == [eos]
    held = eager.clone(min_tokens=5)
    c = llm.generate(prompt, held)[0].outputs[0]
    assert len(c.token_ids) == 6 and c.token_ids[-1] == eos and eos not in c.token_ids[:5]
    assert c.finish_reason == "stop"


def test_stop_strings_match_reference_cut(llm):
    prompt = "def add(a, b):"
    base = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    full = llm.generate(prompt, base)[0].outputs[0]
    text = full.text
    assert len(text) > 12
    stop = text[8:11]
    i = text.index(stop)
    cut = llm.generate(prompt, base.clone(stop=[stop]))[0].outputs[0]
    assert cut.text == text[:i]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert len(cut.token_ids) < len(full.token_ids)
    kept = llm.generate(prompt, base.clone(stop=[stop], include_stop_str_in_output=True))[
        0
    ].outputs[0]
    assert kept.text == text[: i + len(stop)]
    assert_engine_idle(llm)


def test_parallel_sampling_is_seeded_and_independent_of_the_batch(llm):
    prompt = {"prompt_token_ids": [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]}
    sp = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    a = llm.generate(prompt, sp)[0]
    b = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}, prompt, "Hello"],
        [sp.clone(seed=None), sp, sp.clone(seed=1)],
    )[1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3  # children sample differently
    assert_engine_idle(llm)


def test_chat_and_errors_leave_the_engine_clean(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, temperature=0))
    tok = llm.get_tokenizer()
    want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(out[0].prompt_token_ids) == want
    assert len(out[0].outputs[0].token_ids) >= 1
    with pytest.raises(ValueError, match="context"):
        llm.generate(
            ["ok", "x" * 10], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=10_000)]
        )
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**6]})
    with pytest.raises(ValueError, match="top_p"):
        llm.generate("x", SamplingParams(top_p=2))
    assert_engine_idle(llm)


def test_generate_cli_prints_the_same_text(llm, model_dir):
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = llm.generate("Hello world", sp)[0].outputs[0].text
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagectl",
            "generate",
            "--model",
            str(model_dir),
            "--dtype",
            "float32",
            "--num-kv-blocks",
            "64",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "Hello world",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == want + "\n"
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagectl",
            "generate",
            "--model",
            str(model_dir),
            "--top-p",
            "0",
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert bad.returncode == 2 and "top_p" in bad.stderr


def test_default_sampling_params_come_from_the_generation_config(tmp_path):
    path = build_tiny_model(tmp_path / "m", "qwen3", seed=3, with_tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = None
    (path / "config.json").write_text(json.dumps(config))
    gen = {"do_sample": True, "temperature": 0.5, "top_p": 0.8, "max_new_tokens": 3}
    (path / "generation_config.json").write_text(json.dumps(gen))
    with LLM(str(path), dtype="float32", num_kv_blocks=32) as engine:
        sp = engine.get_default_sampling_params()
        assert (sp.temperature, sp.top_p, sp.max_tokens) == (0.5, 0.8, 3)
        assert (sp.top_k, sp.repetition_penalty) == (0, 1.0)  # not in the file: our defaults
        # No eos in this generation config or config.json: every request runs to max_tokens.
        assert engine.engine.eos_token_ids == ()
        outs = engine.generate([[5, 6], [7, 8, 9]])
        assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
        # Explicit params win over the file's.
        out = engine.generate([[5]], SamplingParams(max_tokens=5, temperature=0))[0].outputs[0]
        assert len(out.token_ids) == 5
    with LLM(str(path), dtype="float32", num_kv_blocks=32, generation_config="none") as engine:
        sp = engine.get_default_sampling_params()
        assert (sp.temperature, sp.top_p, sp.max_tokens) == (1.0, 1.0, 16)


def test_generate_cli_reports_engine_errors_in_one_line(model_dir):
    res = subprocess.run(
        [sys.executable, "-m", "pagectl", "generate", "--model", str(model_dir)]
        + ["--kv-cache-memory", "lots", "x"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 2
    assert res.stderr.startswith("pagectl generate: not a size: 'lots'")
    assert "Traceback" not in res.stderr


def test_shutdown_is_idempotent(model_dir):
    engine = LLM(str(model_dir), dtype="float32", num_kv_blocks=32)
    engine.shutdown()
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate("x")
