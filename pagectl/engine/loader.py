"""Loading a Hugging Face checkpoint into our model classes.

- ``resolve_model_path``: a local directory, or a hub id resolved through
  ``huggingface_hub.snapshot_download`` (its cache first; a clear error when offline).
- ``resolve_dtype``: "auto" follows the checkpoint, with half precision falling back to
  float32 on CPU.
- ``iter_checkpoint``: (name, lazy slice) pairs from single-file or sharded
  (``model.safetensors.index.json``) safetensors. Slices are read only where a parameter's
  ``weight_loader`` asks, so a tensor-parallel rank reads just its shard.
- ``load_model``: config -> registry class -> parameters on the device -> weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pagectl.engine.model_config import ModelConfig
from pagectl.engine.models import get_model_class
from pagectl.engine.models.decoder import DecoderForCausalLM
from pagectl.engine.models.parallel import SINGLE, TPGroup

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HALF = (torch.float16, torch.bfloat16)
# Files a model directory needs (weights, configs, tokenizer, chat template).
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


def resolve_model_path(model: str) -> str:
    """A local model directory for ``model`` (a directory path or a hub id).

    Raises ``FileNotFoundError`` with the reason when neither works (e.g. offline).
    """
    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded):
        return os.path.abspath(expanded)
    looks_local = (
        model.startswith((".", "/", "~")) or os.path.exists(expanded) or model.count("/") > 1
    )
    if looks_local:
        raise FileNotFoundError(f"model path {model!r} is not a directory")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id=model, allow_patterns=_HUB_PATTERNS)
    except Exception as e:  # offline, unknown repo, gated, bad id: all end the same way
        raise FileNotFoundError(
            f"model {model!r} is not a local directory and could not be fetched from the "
            f"Hugging Face hub (offline or unknown id?): {type(e).__name__}: {e}"
        ) from None


def resolve_dtype(requested: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """The compute dtype for ``requested`` ("auto", "float32", "bfloat16", "float16")."""
    if requested != "auto":
        if requested not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {requested!r}")
        return _DTYPES[requested]
    dtype = _DTYPES.get(model_config.checkpoint_dtype or "float32", torch.float32)
    if device.type == "cpu" and dtype in _HALF:
        return torch.float32  # half types are slow or unsupported in CPU matmuls
    return dtype


def resolve_kv_cache_dtype(requested: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for ``requested`` ("auto": the model's compute dtype)."""
    if requested == "auto":
        return model_dtype
    if requested not in _DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be auto or one of {sorted(_DTYPES)}, got {requested!r}"
        )
    return _DTYPES[requested]


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a model directory, in load order."""
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (p / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names missing shards: {missing[:3]}")
        return [p / f for f in files]
    single = p / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(p.glob("*.safetensors"))
    if found:
        return found
    raise FileNotFoundError(
        f"no safetensors weights in {p} (only safetensors checkpoints are supported)"
    )


def iter_checkpoint(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(tensor name, lazy safetensors slice) for every tensor of the checkpoint."""
    from safetensors import safe_open

    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_slice(name)


def check_supported(cfg: ModelConfig) -> None:
    """Reject config features the engine does not implement, before any allocation."""
    get_model_class(cfg.architecture)
    raw = cfg.raw
    if raw.get("use_sliding_window") and "sliding_attention" in (raw.get("layer_types") or []):
        raise ValueError("sliding-window attention layers are not supported")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({cfg.num_key_value_heads})"
        )


def load_model(
    path: str | Path,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup = SINGLE,
) -> DecoderForCausalLM:
    """Build the model for ``model_config`` on ``device`` and load its weights from ``path``."""
    check_supported(model_config)
    cls = get_model_class(model_config.architecture)
    with torch.device(device):
        model = cls(model_config, tp, dtype)
    model.load_weights(iter_checkpoint(path))
    return model.eval()
