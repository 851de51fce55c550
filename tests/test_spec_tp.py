"""Speculative decoding at tensor-parallel size 2 (CPU, gloo): n-gram and draft-model
greedy output equals TP = 1 without speculation, token for token.

The draft model runs on rank 0 only (unsharded); the verification step reaches the other
rank as any step does. Chunked prefill at an odd budget and prefix-cache hits included.
"""

from __future__ import annotations

import pytest
from engine_cases import CHUNK7_BS4, build_tiny_engine
from tiny_models import engine_greedy, lazy_reference_models, random_prompts

from pagectl.engine.distributed.workers import TPWorkers
from pagectl.testing.truncated_draft import write_truncated_draft

pytestmark = pytest.mark.slow

VOCAB = 384
MAX_NEW = 12
# Two that repeat themselves (n-gram hits), two sharing a 20-token prefix.
PROMPTS = random_prompts(11, VOCAB, [5, 17], 20, [9, 30]) + [[7, 8, 9, 10, 11] * 5]
CONFIG = dict(CHUNK7_BS4, num_kv_blocks=128)


def test_speculation_at_tp2_matches_tp1_without_it(tmp_path_factory):
    # Qwen3 with 2 KV heads: one per rank.
    models = lazy_reference_models(
        tmp_path_factory, {"qwen3": ("qwen3", None)}, PROMPTS, MAX_NEW, VOCAB
    )
    path, reference = models("qwen3")
    draft = write_truncated_draft(path, tmp_path_factory.mktemp("draft"), 1)
    plain = build_tiny_engine(path, **CONFIG)
    expect = engine_greedy(plain.core, PROMPTS, MAX_NEW)["tokens"]
    plain.shutdown()
    assert expect == reference
    specs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0},
        "draft_model": {
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": 3,
            "disable_by_batch_size": 0,
        },
    }
    workers = TPWorkers.start(2, "cpu")
    try:
        for name, spec in specs.items():
            built = build_tiny_engine(path, tp=2, workers=workers, spec=spec, **CONFIG)
            try:
                out = engine_greedy(built.core, PROMPTS, MAX_NEW)
                assert out["tokens"] == expect, name
                c = built.core.scheduler.counters
                assert 0 < c.spec_decode_num_accepted_tokens < c.spec_decode_num_draft_tokens, name
                assert out["num_cached_tokens"][-2] == 20
                assert built.core.scheduler.kv.pool.num_used_blocks == 0
                # The draft is whole on rank 0: all its KV heads (the target's are split).
                runner = built.core.executor
                assert runner.model.attention_layers[0].num_kv_heads == 1
                if name == "draft_model":
                    assert runner.drafter.runner.model.attention_layers[0].num_kv_heads == 2
            finally:
                built.shutdown()
    finally:
        workers.shutdown()
