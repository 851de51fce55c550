"""The real EngineCore (scheduler + model runner) against transformers, token for token.

Every case runs a batch of 10 prompts of different lengths together, greedy and float32, and
compares each continuation with ``generate(do_sample=False)`` on the same weights: prefix
caching on and off, chunked prefill at small and odd budgets, several block sizes, forced
preemption with a tiny pool, Qwen3 / Qwen2 / Llama (GQA, head_dim != hidden / heads, tied and
untied embeddings).
"""

from __future__ import annotations

import pytest
import torch
from engine_cases import CHUNK7_BS4, DEFAULT, NO_PREFIX_CACHE, build_tiny_engine, preempt_bs4
from tiny_models import engine_greedy, lazy_reference_models, random_prompts

from pagectl.engine.args import EngineArgs
from pagectl.engine.runner import kv_cache
from pagectl.engine.sampling_params import SamplingParams

MAX_NEW = 10
VOCAB = 384


# The last two share a 20-token prefix (prefix-cache hits once the first is computed).
PROMPTS = random_prompts(7, VOCAB, [1, 3, 8, 15, 16, 17, 31, 40], 20, [27, 44])
MODELS = {
    # name: (architecture, config overrides)
    "qwen3": ("qwen3", None),  # GQA 4:2, head_dim 32 != 64 / 4, tied embeddings, q/k norm
    "qwen2": ("qwen2", None),  # GQA 4:1, qkv bias, untied
    "llama": ("llama", None),  # MHA, untied
    "llama_gqa": (
        "llama",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=24, attention_bias=True),
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (model dir, transformers' greedy continuations of PROMPTS), built lazily."""
    return lazy_reference_models(tmp_path_factory, MODELS, PROMPTS, MAX_NEW, VOCAB)


CONFIGS = {
    "default": DEFAULT,
    "no_prefix_cache": NO_PREFIX_CACHE,
    "chunk7_bs4": CHUNK7_BS4,
    "chunk13_bs32": dict(block_size=32, max_num_batched_tokens=13),
    "chunk64_bs16_noprefix": dict(NO_PREFIX_CACHE, max_num_batched_tokens=64),
    # The longest request needs 19 blocks of 4; 22 blocks force preemptions.
    "preempt_bs4": preempt_bs4(22),
}
CASES = [(m, c) for m in ("qwen3", "llama_gqa") for c in CONFIGS] + [
    (m, c) for m in ("qwen2", "llama") for c in ("default", "chunk13_bs32", "preempt_bs4")
]


@pytest.mark.parametrize("model_name,config", CASES)
def test_greedy_matches_transformers(models, model_name, config):
    path, reference = models(model_name)
    built = build_tiny_engine(path, **CONFIGS[config])
    out = engine_greedy(built.core, PROMPTS, MAX_NEW)
    for i, (ours, ref) in enumerate(zip(out["tokens"], reference, strict=True)):
        assert ours == ref, f"prompt {i} (length {len(PROMPTS[i])})"
    counters = built.core.scheduler.counters
    if config.startswith("preempt"):
        assert counters.preemptions > 0
    if config == "chunk7_bs4":
        # The last prompt is admitted after the one sharing its prefix has computed it.
        assert out["num_cached_tokens"][-1] == 20
    assert built.core.scheduler.kv.pool.num_used_blocks == 0


def test_cache_hit_rerun_reports_exact_cached_tokens(models):
    path, reference = models("qwen3")
    built = build_tiny_engine(path, block_size=4)
    first = engine_greedy(built.core, PROMPTS, MAX_NEW, prefix="a")
    # One step admits every prompt: nothing is cached yet.
    assert first["num_cached_tokens"] == [0] * len(PROMPTS)
    second = engine_greedy(built.core, PROMPTS, MAX_NEW, prefix="b")
    # A hit covers whole blocks and never the last prompt token (its logits are needed).
    expect = [(len(p) - 1) // 4 * 4 for p in PROMPTS]
    assert second["num_cached_tokens"] == expect
    assert second["tokens"] == reference
    assert built.core.scheduler.counters.prefix_hits == sum(expect)


def test_parallel_samples_share_blocks_and_copy_on_write(models):
    path, reference = models("qwen3")
    built = build_tiny_engine(path, block_size=4)
    runner = built.core.executor
    copies: list[tuple[int, int]] = []
    apply = runner.kv.copy_blocks
    runner.kv.copy_blocks = lambda pairs: (copies.extend(pairs), apply(pairs))[1]
    prompt = PROMPTS[7]  # 40 tokens: the fork point (39 computed) is inside a block
    built.core.add_request(
        "n2", prompt, SamplingParams(n=2, temperature=0.0, ignore_eos=True, max_tokens=MAX_NEW)
    )
    tokens: dict[int, list[int]] = {0: [], 1: []}
    while built.core.has_unfinished():
        for o in built.core.step():
            tokens[o.index].extend(o.new_token_ids)
    assert copies, "the children's first writes into the shared block must copy it"
    assert tokens[0] == reference[7] and tokens[1] == reference[7]


def test_prompt_logprobs_match_transformers(models):
    from transformers import AutoModelForCausalLM

    path, _ = models("qwen2")
    built = build_tiny_engine(path, block_size=4, max_num_batched_tokens=7)
    prompt = PROMPTS[6]
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2, prompt_logprobs=2)
    built.core.add_request("p", prompt, sp)
    got = []
    while built.core.has_unfinished():
        for o in built.core.step():
            got.extend(o.prompt_logprobs or [])
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert len(got) == len(prompt) - 1
    for p, lp in enumerate(got):
        assert abs(lp.logprob - ref[p, prompt[p + 1]].item()) < 1e-4
        assert [t for t, _ in lp.top] == ref[p].topk(2).indices.tolist()


def test_prompt_positions_are_scored_once_across_recompute():
    from pagectl.engine.outputs import SchedulerOutput
    from pagectl.engine.request import Request
    from pagectl.engine.runner.input_batch import BatchBuilder

    builder = BatchBuilder(4, 99, torch.device("cpu"))
    req = Request("x", list(range(10, 20)), SamplingParams(prompt_logprobs=1, max_tokens=1))
    req.block_ids = [0, 1, 2]
    scored: dict[str, int] = {}
    b1 = builder.build(SchedulerOutput(1, [req], [6], [False], 6), scored)
    assert b1.prompt_logprobs[0].target_token_ids == list(range(11, 17))
    assert scored == {"x": 6}
    # Preempted and recomputed from 0: positions 0..5 are not scored again.
    b2 = builder.build(SchedulerOutput(2, [req], [10], [True], 10), scored)
    assert b2.prompt_logprobs[0].target_token_ids == list(range(17, 20))
    assert b2.logits_rows.tolist() == [6, 7, 8, 9]
    assert b2.sample_indices == [0]


def test_finished_sequences_are_forgotten(models):
    path, _ = models("qwen3")
    built = build_tiny_engine(path)
    forgotten: list[str] = []
    sampler = built.core.executor.sampler
    original = sampler.forget
    sampler.forget = lambda ids: (forgotten.extend(ids), original(ids))[1]
    core = built.core
    for i in range(3):
        core.add_request(f"f{i}", PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=2))
    core.add_request("h", PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=6))
    while core.scheduler.num_running + core.scheduler.num_waiting > 1:
        core.step()
    core.step()  # "h" still runs: this step hands the finished ids to the runner
    assert sorted(forgotten) == ["f0", "f1", "f2"]
    while core.has_unfinished():
        core.step()
    core.add_request("g", [1, 2], SamplingParams(temperature=0.0, max_tokens=1))
    core.step()
    assert forgotten[-1] == "h"


def test_kv_sizing_and_model_info(models, monkeypatch):
    path, _ = models("qwen3")
    # qwen3 tiny: 2 layers, 2 KV heads, head_dim 32, float32 -> 2*2*16*2*32*4 bytes per block.
    per_block = 2 * 2 * 16 * 2 * 32 * 4
    built = build_tiny_engine(path, num_kv_blocks=None, kv_cache_memory="1MiB")
    info = built.core.model_info
    assert info.kv_bytes_per_block == per_block
    num_blocks = (1 << 20) // per_block
    assert built.core.scheduler.kv.num_blocks == num_blocks
    assert info.kv_bytes_per_rank == num_blocks * per_block
    assert built.max_model_len == info.max_model_len == 512  # max_position_embeddings
    assert built.core.scheduler.config.max_num_batched_tokens == 2048
    assert (info.dtype, info.device, info.tp_size) == ("float32", "cpu", 1)
    # Default on CPU: 2 GiB capped at a quarter of RAM (here "RAM" is 4 MiB -> 1 MiB).
    monkeypatch.setattr(kv_cache, "system_memory_bytes", lambda: 4 << 20)
    built = build_tiny_engine(path, num_kv_blocks=None, max_model_len=512)
    assert built.core.scheduler.kv.num_blocks == num_blocks
    # max_model_len is capped at what the pool can hold.
    assert build_tiny_engine(path, num_kv_blocks=8, max_model_len=512).max_model_len == 8 * 16
    # Longer than the model's max_position_embeddings: refused, as vLLM does.
    with pytest.raises(ValueError, match="max_position_embeddings"):
        build_tiny_engine(path, max_model_len=513)
    with pytest.raises(ValueError, match="no room for the KV cache"):
        build_tiny_engine(path, num_kv_blocks=None, kv_cache_memory=1000)
    threads = torch.get_num_threads()
    try:
        build_tiny_engine(path, num_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_kv_cache_dtype_sizes_and_stores_the_cache_in_its_own_dtype(models):
    path, reference = models("qwen3")
    per_block_f32 = 2 * 2 * 16 * 2 * 32 * 4
    built = build_tiny_engine(
        path, num_kv_blocks=None, kv_cache_memory="1MiB", kv_cache_dtype="bfloat16"
    )
    info = built.core.model_info
    runner = built.core.executor
    assert (info.dtype, info.kv_cache_dtype) == ("float32", "bfloat16")
    assert runner.kv.tensor.dtype == torch.bfloat16
    assert info.kv_bytes_per_block == per_block_f32 // 2
    assert built.core.scheduler.kv.num_blocks == (1 << 20) // (per_block_f32 // 2)
    assert info.attention_backend == runner.backend.name
    out = engine_greedy(built.core, PROMPTS[:3], 4)
    # Rounded K/V: the first greedy token of these prompts still agrees (clear margins).
    assert [t[0] for t in out["tokens"]] == [r[0] for r in reference[:3]]
    assert runner.kv.tensor.abs().sum() > 0  # written through the bfloat16 cache
    status = built.core.status()
    assert (status["attention_backend"], status["kv_cache_dtype"]) == (
        runner.backend.name,
        "bfloat16",
    )


def test_kv_cache_dtype_refuses_fp8_and_unknown_names():
    with pytest.raises(ValueError, match="fp8 KV caches are not supported yet"):
        EngineArgs(kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16"):
        EngineArgs(kv_cache_dtype="int4")


def test_bfloat16_model_keeps_logits_in_float32(models):
    path, _ = models("qwen3")
    built = build_tiny_engine(path, dtype="bfloat16", attention_backend="torch")
    runner = built.core.executor
    assert runner.kv.tensor.dtype == torch.bfloat16  # auto: the model's dtype
    assert built.core.model_info.kv_cache_dtype == "bfloat16"
    hidden = torch.zeros(2, runner.model_config.hidden_size, dtype=torch.bfloat16)
    assert runner.model.compute_logits(hidden).dtype == torch.float32
    out = engine_greedy(built.core, PROMPTS[:2], 3)
    assert all(len(t) == 3 for t in out["tokens"])
