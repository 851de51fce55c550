"""Loading a Hugging Face checkpoint into our model classes.

- ``resolve_model_path``: a local directory, or a hub id resolved through
  ``huggingface_hub.snapshot_download`` (its cache first; a clear error when offline).
- ``resolve_dtype``: "auto" follows the checkpoint; on CPU a half-precision checkpoint runs
  in bfloat16 where the CPU multiplies bfloat16 natively, else in float32.
- ``checkpoint_files``: single-file or sharded (``model.safetensors.index.json``) safetensors;
  ``iter_quantized_checkpoint`` yields their tensors as lazy slices, read only where a
  parameter's ``weight_loader`` asks, so a tensor-parallel rank reads just its shard
  (quantized projections are converted whole first).
- ``load_model``: config -> registry class -> parameters on the device -> weights, through
  ``pagectl/engine/quant`` for quantized checkpoints, then load-time quantization.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from pagectl.engine.attention import cpu_build
from pagectl.engine.model_config import ModelConfig
from pagectl.engine.models import get_model_class
from pagectl.engine.models.decoder import DecoderForCausalLM
from pagectl.engine.models.parallel import SINGLE, TPGroup
from pagectl.engine.quant.checkpoint import iter_quantized_checkpoint
from pagectl.engine.quant.config import QuantConfig, resolve_quantization

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
        # float16 has no fast CPU path at all; bfloat16 is fast where the CPU has bfloat16
        # dot products (AVX512-BF16, AMX): the project's kernel and oneDNN use them there
        # (docs/PERFORMANCE.md, section 12). Elsewhere float32, which the kernels serve
        # best without them. A float32 checkpoint stays float32: "auto" never rounds a
        # checkpoint's weights.
        return torch.bfloat16 if cpu_build.has_bf16_instructions() else torch.float32
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


def check_supported(
    cfg: ModelConfig, quantization: str | None = None, device_type: str = "cpu"
) -> QuantConfig:
    """Reject config features the engine does not implement, before any allocation; returns
    the quantization the model loads with (``ValueError`` naming an unsupported method)."""
    get_model_class(cfg.architecture)
    quant = resolve_quantization(quantization, cfg.raw, device_type)
    raw = cfg.raw
    if raw.get("use_sliding_window") and "sliding_attention" in (raw.get("layer_types") or []):
        raise ValueError("sliding-window attention layers are not supported")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({cfg.num_key_value_heads})"
        )
    return quant


def load_model(
    path: str | Path,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup = SINGLE,
    quantization: str | None = None,
) -> DecoderForCausalLM:
    """Build the model for ``model_config`` on ``device`` and load its weights from ``path``;
    ``quantization`` ("int8", "int4" or None) as ``EngineArgs.quantization``."""
    quant = check_supported(model_config, quantization, device.type)
    cls = get_model_class(model_config.architecture)
    with torch.device(device):
        model = cls(model_config, tp, dtype)
    if quant.checkpoint_int4:
        model.expect_int4_checkpoint()
    model.load_weights(iter_quantized_checkpoint(checkpoint_files(path), quant))
    if quant.method is not None:
        # Checkpoint int4 keeps the LM head it ships (float); load-time quantization makes
        # the head int8.
        model.quantize(quant.method, quant.group_size, lm_head=not quant.checkpoint_int4)
    model.quant_config = quant
    return model.eval()
