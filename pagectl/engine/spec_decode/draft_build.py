"""Start-up of the draft-model method: check the draft against the target, load it, give
rank 0's runner its proposer (``draft_model.py``).

The draft must share the target's tokenizer (same vocabulary, same special tokens), so that
its token ids mean the target's; it runs unsharded on rank 0, in the target's dtype, with
a KV pool of the target's block count and block size. Start-up refuses, naming the
difference, a draft that cannot serve: another tokenizer, an architecture or feature the
engine does not run, a context shorter than the target's ``max_model_len``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagectl.engine.loader import check_supported, load_model, resolve_model_path
from pagectl.engine.model_config import ModelConfig
from pagectl.engine.runner.kv_cache import kv_bytes_per_block
from pagectl.engine.spec_decode.config import SpeculativeConfig
from pagectl.engine.tokenizer import load_tokenizer

_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


@dataclass
class DraftModel:
    """The draft model as loaded on rank 0."""

    path: str
    config: ModelConfig
    model: Any
    # KV bytes per block of the draft's pool (added to the target's when sizing the pool).
    kv_bytes_per_block: int


def resolve_draft(spec: SpeculativeConfig, device_type: str) -> tuple[str, ModelConfig]:
    """The draft's directory and config; ``ValueError`` if the engine cannot run it."""
    assert spec.model is not None
    try:
        path = resolve_model_path(spec.model)
        cfg = ModelConfig.from_dir(path)
        check_supported(cfg, None, device_type)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config.model {spec.model!r}: {e}") from None
    return path, cfg


def check_same_tokenizer(
    target_tokenizer: Any | None, target_cfg: ModelConfig, draft_path: str, draft_cfg: ModelConfig
) -> None:
    """Refuse a draft whose tokenizer differs from the target's (``ValueError``)."""
    draft_tokenizer = load_tokenizer(draft_path)
    what = "speculative_config: the draft model must share the target's tokenizer"
    if target_tokenizer is None or draft_tokenizer is None:
        if target_tokenizer is not None or draft_tokenizer is not None:
            which = "target" if target_tokenizer is None else "draft"
            raise ValueError(f"{what}, but the {which} model has no tokenizer")
        if target_cfg.vocab_size != draft_cfg.vocab_size:
            raise ValueError(
                f"{what}: neither has a tokenizer and their vocabulary sizes differ "
                f"({target_cfg.vocab_size} and {draft_cfg.vocab_size})"
            )
        return
    tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if tv != dv:
        diff = sorted(set(tv.items()) ^ set(dv.items()))[:3]
        raise ValueError(
            f"{what}; their vocabularies differ ({len(tv)} and {len(dv)} tokens; e.g. "
            f"{', '.join(f'{t!r}: {i}' for t, i in diff)})"
        )
    for attr in _SPECIAL_IDS:
        a, b = getattr(target_tokenizer, attr, None), getattr(draft_tokenizer, attr, None)
        if a != b:
            raise ValueError(f"{what}; their {attr} differ ({a} and {b})")
    ts = sorted(target_tokenizer.all_special_tokens)
    ds = sorted(draft_tokenizer.all_special_tokens)
    if ts != ds:
        raise ValueError(f"{what}; their special tokens differ ({ts} and {ds})")


def load_draft(
    path: str,
    cfg: ModelConfig,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device: torch.device,
    block_size: int,
) -> DraftModel:
    """Load the whole draft (unsharded) on this device in the target's dtype."""
    model = load_model(path, cfg, dtype, device)
    attn = model.attention_layers[0]
    per_block = kv_bytes_per_block(
        cfg.num_hidden_layers, block_size, attn.num_kv_heads, attn.head_dim, kv_dtype
    )
    return DraftModel(path, cfg, model, per_block)


def check_draft_context(draft: DraftModel, max_model_len: int) -> None:
    if draft.config.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative_config: the draft model's max_position_embeddings "
            f"({draft.config.max_position_embeddings}) is shorter than max_model_len "
            f"({max_model_len}); pass a smaller --max-model-len"
        )
