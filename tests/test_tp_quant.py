"""Weight-only quantization under tensor parallelism, in a real two-process group (gloo).

Each rank quantizes its own shard after loading (per output channel for int8, in groups
along the input features for int4, the LM head to int8), so TP = 2 must decode greedily
exactly as TP = 1 with the same quantization: a batch of prompts of different lengths with
chunked prefill and a prefix-cache hit. A shard quantized on the whole tensor, a group
split across ranks or a rank left in float would change the logits and the tokens.
"""

from __future__ import annotations

import pytest
from tiny_models import build_tiny_model, engine_greedy, random_prompts

from pagectl.engine.args import EngineArgs
from pagectl.engine.builder import build_engine
from pagectl.engine.distributed.workers import TPWorkers

pytestmark = pytest.mark.slow

VOCAB = 384
MAX_NEW = 8
# The last two share a 20-token prefix (a prefix-cache hit); 37 tokens is chunked by 16.
PROMPTS = random_prompts(5, VOCAB, [3, 16, 37], 20, [9, 30])


# 4 heads, 2 KV heads: one KV head per rank at TP = 2. Every projection's input features
# per rank (256 for q/k/v and gate/up, 128 for o, 256 for down) are a multiple of the int4
# group (128), so each rank's groups are exactly the TP = 1 groups over its features. (With
# fewer features per rank than a group, a rank must use a smaller group than TP = 1 does,
# and int4 output then differs from TP = 1 by that rounding.)
SHAPE = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("qwen3"), "qwen3", vocab_size=VOCAB, config_overrides=SHAPE
    )


@pytest.fixture(scope="module")
def workers():
    w = TPWorkers.start(2, "cpu")
    yield w
    procs = list(w.procs.values())
    w.shutdown()
    assert [p.exitcode for p in procs] == [0] * len(procs)


def _greedy(path, method: str, tp: int, workers: TPWorkers | None = None) -> dict:
    args = EngineArgs(
        model=str(path),
        dtype="float32",
        quantization=method,
        tensor_parallel_size=tp,
        num_kv_blocks=64,
        max_num_batched_tokens=16,
    )
    built = build_engine(args, tp_workers=workers)
    try:
        model = built.core.executor.model
        # Every projection and the LM head of this rank run a quantized kernel.
        layers = model._projections() + [model.lm_head]
        assert all(layer.quantized is not None for layer in layers)
        out = engine_greedy(built.core, PROMPTS, MAX_NEW)
        assert built.core.scheduler.kv.pool.num_used_blocks == 0
        return out
    finally:
        built.shutdown()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_tp2_quantized_greedy_equals_tp1(model_dir, workers, method):
    single = _greedy(model_dir, method, 1)
    split = _greedy(model_dir, method, 2, workers)
    assert split["tokens"] == single["tokens"]
    assert split["num_cached_tokens"] == single["num_cached_tokens"]
    assert split["num_cached_tokens"][-1] == 16  # the shared prefix's full blocks
    assert all(len(t) == MAX_NEW for t in split["tokens"])
