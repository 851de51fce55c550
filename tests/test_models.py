"""Our model modules against transformers: logits, rotary scaling types, TP sharding math."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import build_tiny_model

from pagectl.engine.attention import TorchPagedAttention
from pagectl.engine.loader import load_model
from pagectl.engine.model_config import ModelConfig, parse_rope
from pagectl.engine.models import SUPPORTED_ARCHITECTURES, get_model_class
from pagectl.engine.models.embedding import ParallelLMHead, VocabParallelEmbedding
from pagectl.engine.models.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagectl.engine.models.parallel import TPGroup
from pagectl.engine.models.rotary import RotaryEmbedding
from pagectl.engine.outputs import SchedulerOutput
from pagectl.engine.request import Request
from pagectl.engine.runner.input_batch import BatchBuilder
from pagectl.engine.runner.kv_cache import KVCachePool
from pagectl.engine.sampling_params import SamplingParams

# Llama variant with GQA 8:2, head_dim (24) != hidden / heads (8), and attention biases.
LLAMA_GQA = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=24, attention_bias=True)


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama", "llama_gqa"])
def model_dir(request, tmp_path_factory):
    name = request.param
    arch = "llama" if name == "llama_gqa" else name
    overrides = LLAMA_GQA if name == "llama_gqa" else None
    return build_tiny_model(
        tmp_path_factory.mktemp(name), arch, with_tokenizer=False, config_overrides=overrides
    )


def hf_logits(path, prompt):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0]


def run_steps(model, prompts, steps, block_size=4, num_blocks=64):
    """Feed chunks of ``prompts`` through the model step by step, as the runner would.

    ``steps``: list of {prompt index: tokens to feed}. Returns, per prompt, the logits of
    every row it fed, in position order.
    """
    attn = model.attention_layers[0]
    cpu = torch.device("cpu")
    pool = KVCachePool(
        len(model.attention_layers),
        num_blocks,
        block_size,
        attn.num_kv_heads,
        attn.head_dim,
        model.dtype,
        cpu,
    )
    backend = TorchPagedAttention(cpu)
    model.bind_kv_cache(pool.layer_caches(), backend)
    model.rotary_emb.ensure_cache(512)
    builder = BatchBuilder(block_size, pool.scratch_block, cpu)
    reqs = [Request(str(i), p, SamplingParams(max_tokens=1)) for i, p in enumerate(prompts)]
    free = list(range(num_blocks))[::-1]
    logits: dict[int, list[torch.Tensor]] = {}
    for step in steps:
        order = list(step)
        for i in order:
            req = reqs[i]
            need = -(-(req.num_computed_tokens + step[i]) // block_size)
            while len(req.block_ids) < need:
                req.block_ids.append(free.pop())
        counts = [step[i] for i in order]
        seqs = [reqs[i] for i in order]
        so = SchedulerOutput(0, seqs, counts, [True] * len(seqs), sum(counts))
        batch = builder.build(so, {})
        backend.prepare(batch.meta)
        with torch.inference_mode():
            out = model.compute_logits(model(batch.input_ids, batch.positions, batch.meta))
        rows = batch.meta.query_start_loc_host
        for r, idx in enumerate(batch.order):
            logits.setdefault(order[idx], []).append(out[rows[r] : rows[r + 1]])
        for i in order:
            reqs[i].num_computed_tokens += step[i]
    return {i: torch.cat(v) for i, v in logits.items()}


@pytest.mark.parametrize("packed", [False, True], ids=["torch", "packed"])
def test_logits_match_transformers(model_dir, packed):
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, cfg, torch.float32, torch.device("cpu"))
    if packed:  # the CPU path: packed matmuls and the fused norm, rotary and SiLU ops
        model.pack_for_cpu()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (11, 1, 23, 6)]
    # Step 1: fresh chunks and a 1-token prompt; step 2: the rest, so chunks with cached
    # context and single-row (decode path) sequences are both exercised.
    ours = run_steps(model, prompts, [{0: 7, 1: 1, 2: 16, 3: 5}, {0: 4, 2: 7, 3: 1}])
    for i, p in enumerate(prompts):
        torch.testing.assert_close(ours[i], hf_logits(model_dir, p), atol=1e-4, rtol=1e-4)


# -- rotary embeddings ------------------------------------------------------------------------

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.5, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0},
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 1000000.0,
    },
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 16,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
        "rope_theta": 10000.0,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 500000.0,
    },
}


@pytest.mark.parametrize("kind", sorted(ROPES))
@pytest.mark.parametrize("seq_len", [100, 300])
def test_rotary_matches_transformers(kind, seq_len):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        rope_parameters=dict(ROPES[kind]),
    )
    hf_rot = LlamaRotaryEmbedding(hf_cfg)
    positions = torch.arange(seq_len)
    cos_ref, sin_ref = hf_rot(torch.zeros(1, dtype=torch.float32), positions[None])
    rope = parse_rope(hf_cfg.to_dict())
    ours = RotaryEmbedding(32, rope, 128)
    ours.ensure_cache(seq_len)
    # Dynamic NTK past the pre-trained length needs each row's sequence length.
    lens = torch.full((seq_len,), seq_len) if seq_len > 128 else None
    cos, sin = ours.cos_sin(positions, torch.float32, lens)
    torch.testing.assert_close(cos[:, 0], cos_ref[0, :, :16], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(sin[:, 0], sin_ref[0, :, :16], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(cos_ref[0, :, :16], cos_ref[0, :, 16:])


def test_v4_and_v5_rope_styles_agree():
    v4 = {
        "rope_theta": 1e6,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    }
    v5 = {
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 1e6,
        }
    }
    assert parse_rope(v4) == parse_rope(v5)
    assert parse_rope({"rope_theta": 5e5}).theta == 5e5
    assert parse_rope({}).rope_type == "default"
    with pytest.raises(ValueError, match="supported: default, linear, dynamic, yarn, llama3"):
        parse_rope({"rope_scaling": {"type": "longrope", "factor": 2.0}})


# -- registry -----------------------------------------------------------------------------------


def test_unsupported_architecture_names_supported_ones():
    assert set(SUPPORTED_ARCHITECTURES) == {
        "Qwen3ForCausalLM",
        "Qwen2ForCausalLM",
        "LlamaForCausalLM",
    }
    with pytest.raises(ValueError) as e:
        get_model_class("MistralForCausalLM")
    msg = str(e.value)
    assert "MistralForCausalLM" in msg and "Qwen3ForCausalLM" in msg and "LlamaForCausalLM" in msg


# -- tensor-parallel sharding (weight loaders and partial results; no process group) -----------


class PartialGroup(TPGroup):
    """A TP group whose all-reduce leaves partial results (the test sums them itself)."""

    def all_reduce(self, x):
        return x


def test_qkv_shards_heads_and_replicates_kv():
    g = torch.Generator().manual_seed(0)
    wq, wk, wv = (torch.randn(n, 5, generator=g) for n in (4 * 3, 2 * 3, 2 * 3))
    for rank in range(2):
        layer = QKVParallelLinear(5, 3, 4, 2, tp=TPGroup(rank, 2))
        for shard, w in zip("qkv", (wq, wk, wv), strict=True):
            layer.weight.weight_loader(layer.weight, w, shard)
        expect = torch.cat(
            [wq[rank * 6 : rank * 6 + 6], wk[rank * 3 : rank * 3 + 3], wv[rank * 3 : rank * 3 + 3]]
        )
        assert torch.equal(layer.weight, expect)
    # One KV head on four ranks: every rank holds it (replicated).
    wk1 = torch.randn(3, 5, generator=g)
    for rank in range(4):
        layer = QKVParallelLinear(5, 3, 4, 1, tp=TPGroup(rank, 4))
        layer.weight.weight_loader(layer.weight, wk1, "k")
        assert torch.equal(layer.weight[3:6], wk1)
    # Two KV heads on four ranks: ranks 0-1 hold head 0, ranks 2-3 head 1.
    wk2 = torch.randn(6, 5, generator=g)
    for rank in range(4):
        layer = QKVParallelLinear(5, 3, 4, 2, tp=TPGroup(rank, 4))
        layer.weight.weight_loader(layer.weight, wk2, "k")
        head = rank // 2
        assert torch.equal(layer.weight[3:6], wk2[head * 3 : head * 3 + 3])


def test_impossible_kv_split_fails_with_the_numbers():
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\).*\(2\)"):
        QKVParallelLinear(8, 2, 4, 3, tp=TPGroup(0, 2))
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\).*\(4\)"):
        QKVParallelLinear(8, 2, 6, 2, tp=TPGroup(0, 4))


def test_column_and_row_parallel_reassemble_the_full_layer():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 6, generator=g)
    w_gate, w_up = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    w_down, b_down = torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
    gate_up_parts, down_sum = [], 0
    for rank in range(2):
        tp = PartialGroup(rank, 2)
        gu = MergedColumnParallelLinear(6, [8, 8], tp=tp)
        gu.weight.weight_loader(gu.weight, w_gate, 0)
        gu.weight.weight_loader(gu.weight, w_up, 1)
        out = gu(x)  # [its gate rows | its up rows]
        gate_up_parts.append(out)
        down = RowParallelLinear(8, 6, bias=True, tp=tp)
        down.weight.weight_loader(down.weight, w_down)
        down.bias.weight_loader(down.bias, b_down)
        h = torch.nn.functional.silu(out[:, :4]) * out[:, 4:]
        down_sum = down_sum + down(h) - (b_down if rank else 0)  # bias added once overall
    gate = torch.cat([p[:, :4] for p in gate_up_parts], dim=1)
    up = torch.cat([p[:, 4:] for p in gate_up_parts], dim=1)
    torch.testing.assert_close(gate, x @ w_gate.T)
    torch.testing.assert_close(up, x @ w_up.T)
    full = (torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T + b_down
    torch.testing.assert_close(down_sum, full)


def test_vocab_parallel_embedding_covers_the_vocab_once():
    g = torch.Generator().manual_seed(2)
    table = torch.randn(10, 4, generator=g)
    ids = torch.tensor([0, 3, 4, 7, 8, 9])
    total = 0
    for rank in range(3):
        emb = VocabParallelEmbedding(10, 4, tp=PartialGroup(rank, 3))
        emb.weight.weight_loader(emb.weight, table)
        total = total + emb(ids)
    torch.testing.assert_close(total, table[ids])
    head = ParallelLMHead(10, 4)
    head.weight.weight_loader(head.weight, table)
    h = torch.randn(2, 4, generator=g)
    torch.testing.assert_close(head.compute_logits(h), h @ table.T)


def test_weight_loader_reads_only_its_slice_from_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    w = torch.arange(24.0).view(6, 4)
    save_file({"w": w}, str(tmp_path / "x.safetensors"))
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        lazy = f.get_slice("w")
        layer = RowParallelLinear(4, 6, tp=TPGroup(1, 2))
        layer.weight.weight_loader(layer.weight, lazy)
    assert torch.equal(layer.weight, w[:, 2:])
    assert np.asarray(layer.weight).shape == (6, 2)
