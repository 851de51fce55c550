"""Loading: config styles, generation config, sharded checkpoints, dtype, model resolution."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_model, engine_greedy, hf_greedy, read_config

from pagectl.engine import builder
from pagectl.engine.args import EngineArgs
from pagectl.engine.builder import build_engine, resolve_model
from pagectl.engine.loader import checkpoint_files, load_model, resolve_dtype, resolve_model_path
from pagectl.engine.model_config import ModelConfig, generation_defaults


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3")


def _rewrite_config(path, **changes):
    cfg = read_config(path)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def test_v5_config_fields(qwen3_dir):
    cfg = ModelConfig.from_dir(qwen3_dir)
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 4, 2)
    assert cfg.head_dim == 32 and cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads
    assert cfg.tie_word_embeddings is True
    assert cfg.checkpoint_dtype == "float32"
    assert cfg.rope.rope_type == "default" and cfg.rope.theta == 10000.0
    assert cfg.eos_token_ids == (0,)
    assert cfg.max_position_embeddings == 512


def test_v4_style_config_with_llama3_rope_matches_transformers(tmp_path):
    # A v4-style checkpoint: torch_dtype, top-level rope_theta, rope_scaling with "type".
    path = build_tiny_model(tmp_path / "m", "llama", with_tokenizer=False)
    _rewrite_config(
        path,
        dtype=None,
        rope_parameters=None,
        torch_dtype="float32",
        rope_theta=500000.0,
        rope_scaling={
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    cfg = ModelConfig.from_dir(path)
    assert cfg.checkpoint_dtype == "float32"
    assert cfg.rope.rope_type == "llama3" and cfg.rope.theta == 500000.0
    assert cfg.rope.original_max_position_embeddings == 16
    prompts = [[5, 9, 33, 2, 17, 250, 3, 3, 8, 100, 41, 7, 19, 60, 2, 11, 90, 13, 4], [7, 1, 2]]
    core = build_engine(EngineArgs(model=str(path), num_kv_blocks=32, block_size=4)).core
    ours = engine_greedy(core, prompts, 10)["tokens"]
    assert ours == hf_greedy(path, prompts, 10)


def test_generation_config_eos_list(tmp_path):
    path = build_tiny_model(tmp_path / "m", "qwen2", with_tokenizer=False)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5, 0]}))
    assert ModelConfig.from_dir(path).eos_token_ids == (0, 5)
    built = build_engine(EngineArgs(model=str(path), num_kv_blocks=16))
    assert built.eos_token_ids == (0, 5)
    assert built.tokenizer is None
    # No generation config: config.json's eos.
    (path / "generation_config.json").unlink()
    _rewrite_config(path, eos_token_id=7)
    assert ModelConfig.from_dir(path).eos_token_ids == (7,)


def test_generation_config_sampling_defaults():
    qwen3_style = {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.0,
        "repetition_penalty": 1.05,
        "max_new_tokens": 300,
        "eos_token_id": [1, 2],
    }
    assert generation_defaults(qwen3_style) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.0,
        "repetition_penalty": 1.05,
        "max_tokens": 300,
    }
    # transformers decodes greedily without do_sample and ignores the sampling knobs.
    for flag in ({}, {"do_sample": False}):
        got = generation_defaults({**flag, "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 9})
        assert got == {"max_tokens": 9}
    # Values SamplingParams would refuse are left out, one by one.
    sloppy = {
        "do_sample": True,
        "temperature": -1,
        "top_p": 0,
        "top_k": "20",
        "min_p": 0.05,
        "repetition_penalty": True,
        "max_new_tokens": 0,
    }
    assert generation_defaults(sloppy) == {"min_p": 0.05}
    assert generation_defaults({}) == {}


def test_engine_takes_sampling_defaults_unless_turned_off(tmp_path):
    path = build_tiny_model(tmp_path / "m", "qwen3", with_tokenizer=False)
    gen = {"do_sample": True, "temperature": 0.7, "top_k": 5, "eos_token_id": 0}
    (path / "generation_config.json").write_text(json.dumps(gen))
    assert ModelConfig.from_dir(path).sampling_defaults == {"temperature": 0.7, "top_k": 5}
    built = build_engine(EngineArgs(model=str(path), num_kv_blocks=16))
    assert built.sampling_defaults == {"temperature": 0.7, "top_k": 5}
    built.shutdown()
    off = build_engine(EngineArgs(model=str(path), num_kv_blocks=16, generation_config="none"))
    assert off.sampling_defaults == {}
    off.shutdown()
    with pytest.raises(ValueError, match="generation_config must be one of auto, none"):
        EngineArgs(generation_config="vllm")


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single = build_tiny_model(tmp_path / "one", "qwen2", with_tokenizer=False, seed=4)
    sharded = build_tiny_model(
        tmp_path / "many", "qwen2", with_tokenizer=False, seed=4, max_shard_size="100KB"
    )
    assert len(checkpoint_files(single)) == 1
    assert len(checkpoint_files(sharded)) > 2
    cfg = ModelConfig.from_dir(single)
    a = load_model(single, cfg, torch.float32, torch.device("cpu"))
    b = load_model(sharded, cfg, torch.float32, torch.device("cpu"))
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_dtype_resolution(monkeypatch):
    from pagectl.engine.attention import cpu_build

    monkeypatch.setattr(cpu_build, "has_bf16_instructions", lambda: False)
    cfg = ModelConfig.from_dict(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "vocab_size": 8,
            "hidden_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "torch_dtype": "bfloat16",
        }
    )
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cfg, cpu) == torch.float32  # half falls back on CPU
    assert resolve_dtype("auto", cfg, cuda) == torch.bfloat16
    assert resolve_dtype("bfloat16", cfg, cpu) == torch.bfloat16
    assert resolve_dtype("float16", cfg, cpu) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", cfg, cpu)
    # Where the CPU multiplies bfloat16 natively, a half checkpoint runs in bfloat16 there
    # (float16 too: it has no fast CPU path); a float32 one stays float32.
    monkeypatch.setattr(cpu_build, "has_bf16_instructions", lambda: True)
    assert resolve_dtype("auto", cfg, cpu) == torch.bfloat16
    assert resolve_dtype("auto", cfg, cuda) == torch.bfloat16
    half = ModelConfig.from_dict({**cfg.raw, "torch_dtype": "float16"})
    assert resolve_dtype("auto", half, cpu) == torch.bfloat16
    f32 = ModelConfig.from_dict({**cfg.raw, "torch_dtype": "float32"})
    assert resolve_dtype("auto", f32, cpu) == torch.float32
    assert resolve_dtype("float32", cfg, cpu) == torch.float32


def test_bf16_instruction_probe_reads_the_cpu():
    from pagectl.engine.attention import cpu_build

    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() != "x86_64" or not cpuinfo.is_file():
        pytest.skip("an x86-64 /proc/cpuinfo to compare with")
    flags = cpuinfo.read_text().split()
    native = "avx512_bf16" in flags or "amx_tile" in flags
    assert cpu_build.has_bf16_instructions() == native
    assert ("-mavx512bf16" in cpu_build.isa_flags()) == (
        "avx512_bf16" in flags and torch.backends.cpu.get_cpu_capability() == "AVX512"
    )


def test_half_checkpoint_loads_as_float32_on_cpu(tmp_path, monkeypatch):
    from pagectl.engine.attention import cpu_build

    monkeypatch.setattr(cpu_build, "has_bf16_instructions", lambda: False)
    path = build_tiny_model(tmp_path / "m", "qwen3", with_tokenizer=False)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).save_pretrained(str(path))
    assert ModelConfig.from_dir(path).checkpoint_dtype == "bfloat16"
    built = build_engine(EngineArgs(model=str(path), num_kv_blocks=8))
    runner = built.core.executor
    assert runner.dtype == torch.float32
    assert built.core.model_info.dtype == "float32"
    assert all(p.dtype == torch.float32 for p in runner.model.parameters())
    bf16 = build_engine(EngineArgs(model=str(path), num_kv_blocks=8, dtype="bfloat16"))
    assert bf16.core.executor.kv.tensor.dtype == torch.bfloat16
    out = engine_greedy(bf16.core, [[1, 2, 3, 4, 5]], 3)
    assert len(out["tokens"][0]) == 3


def test_unsupported_architecture_fails_clearly(tmp_path):
    path = build_tiny_model(tmp_path / "m", "llama", with_tokenizer=False)
    _rewrite_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        ValueError, match="GPT2LMHeadModel.*supported architectures: LlamaForCausalLM"
    ):
        build_engine(EngineArgs(model=str(path), num_kv_blocks=8))


def test_checkpoint_mismatches_fail_clearly(tmp_path):
    from safetensors.torch import load_file, save_file

    path = build_tiny_model(tmp_path / "m", "llama", with_tokenizer=False)
    cfg = ModelConfig.from_dir(path)
    weights = load_file(str(path / "model.safetensors"))
    weights.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks weights.*qkv_proj"):
        load_model(path, cfg, torch.float32, torch.device("cpu"))
    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 5)
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="shape mismatch"):
        load_model(path, cfg, torch.float32, torch.device("cpu"))
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        load_model(path, cfg, torch.float32, torch.device("cpu"))


def test_model_resolution(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        resolve_model_path(str(tmp_path / "absent"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="could not be fetched"):
        resolve_model_path("pagectl-test/no-such-model")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    # None: the built-in model directory, or a clear error when it is absent.
    monkeypatch.setattr(builder, "BUILTIN_MODEL_DIR", tmp_path / "builtin")
    with pytest.raises(FileNotFoundError, match="built-in model"):
        resolve_model(None)
    build_tiny_model(tmp_path / "builtin", "qwen3", with_tokenizer=False)
    assert resolve_model(None) == str(tmp_path / "builtin")
    built = build_engine(EngineArgs(num_kv_blocks=8))
    assert built.model_name == "pycoder" and built.core.model_info.model == "pycoder"
