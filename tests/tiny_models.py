"""Tiny Hugging Face checkpoints built locally: random weights from a config, and a small
byte-level BPE tokenizer trained with ``tokenizers``. No hub access needed.

``build_tiny_model(dir, arch=...)`` writes a real model directory (config.json, safetensors,
tokenizer files, generation_config.json, chat template) that the real loading code reads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TOKENIZER_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "import os\nimport sys\n\nprint(os.getcwd())\n",
    "Hello world! Paged attention stores the KV cache in fixed-size blocks.",
    "for i in range(10):\n    print(i * i)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "A request is admitted when the scheduler finds free blocks for its prompt.",
    "0123456789 + - * / = ( ) [ ] { } : ; , . ! ? ' \"",
]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ARCHS = {
    # Qwen3: q/k RMSNorm, head_dim != hidden / heads, GQA 4:2, tied embeddings.
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
    ),
    # Qwen2: qkv bias, GQA 4:1, untied.
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    ),
    # Llama: no biases, MHA, untied.
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 384) -> None:
    """Train a byte-level BPE tokenizer and save it in Hugging Face format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_tiny_model(
    out_dir: str | os.PathLike,
    arch: str = "qwen3",
    *,
    seed: int = 0,
    vocab_size: int = 384,
    max_position_embeddings: int = 512,
    with_tokenizer: bool = True,
    max_shard_size: str | None = None,
    config_overrides: dict | None = None,
) -> Path:
    """Write a random-weight model directory for ``arch`` (qwen3, qwen2, llama)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if with_tokenizer:
        build_tokenizer(out, vocab_size)
    spec = dict(ARCHS[arch])
    model_type = spec.pop("model_type")
    spec.update(
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )
    if config_overrides:
        spec.update(config_overrides)
    config = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Random init is small (std 0.02); scale weights up so logits are not flat and greedy
    # choices are decided by clear margins.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
    kwargs = {}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), safe_serialization=True, **kwargs)
    GenerationConfig(eos_token_id=0, pad_token_id=0).save_pretrained(str(out))
    return out


def read_config(model_dir: str | os.PathLike) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def hf_greedy(
    model_dir: str | os.PathLike, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Reference continuations: transformers ``generate(do_sample=False)``, one prompt at a
    time, float32, never stopping early (EOS ignored, like ``ignore_eos=True``)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(gen[0, len(p) :].tolist())
    return out


def random_prompts(
    seed: int, vocab_size: int, lengths: list[int], prefix_len: int, tail_lengths: list[int]
) -> list[list[int]]:
    """Random prompts (ids ``1..vocab_size - 1``) of ``lengths``, then one per ``tail_lengths``
    that starts with the same random ``prefix_len`` tokens (prefix-cache hits once the first
    of them is computed)."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(1, vocab_size, (n,), generator=g).tolist()

    shared = rand(prefix_len)
    return [rand(n) for n in lengths] + [shared + rand(n) for n in tail_lengths]


def lazy_reference_models(
    tmp_path_factory, models: dict, prompts: list[list[int]], max_new_tokens: int, vocab_size: int
):
    """A function name -> (model dir, transformers' greedy continuations of ``prompts``) that
    builds each model on first use. ``models``: name -> (architecture, config overrides)."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            arch, overrides = models[name]
            path = build_tiny_model(
                tmp_path_factory.mktemp(name),
                arch,
                vocab_size=vocab_size,
                config_overrides=overrides,
            )
            cache[name] = (path, hf_greedy(path, prompts, max_new_tokens))
        return cache[name]

    return get


def engine_greedy(core, prompts: list[list[int]], max_new_tokens: int, prefix: str = "r") -> dict:
    """Run ``prompts`` together through an ``EngineCore`` greedily (ignore_eos) to the end.

    Returns {"tokens": [per prompt], "num_cached_tokens": [per prompt]}.
    """
    from pagectl.engine.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_new_tokens)
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        core.add_request(rid, p, sp)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    cached: dict[str, int] = {}
    while core.has_unfinished():
        for o in core.step():
            tokens[o.request_id].extend(o.new_token_ids)
            cached[o.request_id] = o.num_cached_tokens
    return {
        "tokens": [tokens[r] for r in ids],
        "num_cached_tokens": [cached.get(r, 0) for r in ids],
    }
