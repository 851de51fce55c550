"""Synthetic benchmark models: a known architecture with random weights, built locally.

``ensure_synthetic_model("qwen3-33m")`` writes a Hugging Face model directory (config.json,
safetensors, generation_config.json, tokenizer files) into a cache directory the first time
and returns its path afterwards, so anyone can rerun a benchmark without a download.

The tokenizer is a word-level one with one word per token id ("<|endoftext|>", "t1", "t2",
...). Decoding any id sequence and encoding the text again gives back exactly the same ids,
so a peer that only accepts text prompts sees the same tokens as one given token ids.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

# name -> Hugging Face config fields. Sizes follow the performance targets of the project.
SYNTHETIC_MODELS: dict[str, dict] = {
    # Qwen3 architecture, about 33.6M parameters (tied embeddings).
    "qwen3-33m": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=16384,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    ),
    # The shape of Qwen3-0.6B (about 596M parameters with its 151,936-token vocabulary, tied
    # embeddings), random weights: the second standard size.
    "qwen3-0.6b": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    # A very small model of the same architecture, for smoke tests of the harness.
    "qwen3-tiny": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    ),
}

EOS_TOKEN = "<|endoftext|>"
_MARKER = "pagectl_synthetic.json"


def default_cache_dir() -> Path:
    """``$PAGECTL_BENCH_CACHE``, else ``$XDG_CACHE_HOME/pagectl/bench-models``."""
    env = os.environ.get("PAGECTL_BENCH_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagectl" / "bench-models"


def token_word(token_id: int) -> str:
    """The tokenizer's word for ``token_id``."""
    return EOS_TOKEN if token_id == 0 else f"t{token_id}"


def ensure_synthetic_model(
    name: str, cache_dir: str | os.PathLike | None = None, seed: int = 0
) -> Path:
    """Return the directory of synthetic model ``name``, building it on first use.

    Built into a temporary directory and renamed into place, so a half-written model is
    never picked up. Rebuilt when the cached one was made from a different spec.
    """
    if name not in SYNTHETIC_MODELS:
        raise ValueError(f"unknown synthetic model {name!r}; known: {', '.join(SYNTHETIC_MODELS)}")
    spec = dict(SYNTHETIC_MODELS[name], seed=seed)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"{name}-seed{seed}"
    marker = target / _MARKER
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == spec:
                return target
        except (OSError, ValueError):
            pass
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        _build(tmp, SYNTHETIC_MODELS[name], seed)
        (tmp / _MARKER).write_text(json.dumps(spec, sort_keys=True))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _build(out: Path, fields: dict, seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    cfg = dict(fields)
    model_type = cfg.pop("model_type")
    cfg.update(bos_token_id=None, eos_token_id=0, pad_token_id=0)
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(eos_token_id=0, pad_token_id=0, do_sample=False).save_pretrained(str(out))
    build_word_tokenizer(out, cfg["vocab_size"])


def build_word_tokenizer(out: str | os.PathLike, vocab_size: int) -> None:
    """Save a word-level tokenizer with exactly ``vocab_size`` tokens, one word per id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token_word(i): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, unk_token=EOS_TOKEN
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + ' ' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    fast.save_pretrained(str(out))
