"""A model's shape and options, read from a Hugging Face model directory.

Reads ``config.json`` in both styles found in the wild:

- transformers v4: ``torch_dtype``, top-level ``rope_theta``, ``rope_scaling`` (with ``type`` or
  ``rope_type``);
- transformers v5: ``dtype``, ``rope_parameters`` (holding ``rope_theta`` and ``rope_type``).

and ``generation_config.json`` (``eos_token_id`` may be an int or a list; its sampling
settings become the model's default sampling parameters). No transformers
import: the engine reads the JSON itself, so a checkpoint saved by any version loads the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

# Keys a rope dict may carry besides the type and theta (the rest is rejected loudly).
_ROPE_KEYS = {
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "default": set(),
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from either config style."""

    # One of ROPE_TYPES.
    rope_type: str = "default"
    # Base wavelength.
    theta: float = 10000.0
    # Fraction of head_dim that is rotated (1.0 for every supported architecture's defaults).
    partial_rotary_factor: float = 1.0
    # Scaling factor (linear, dynamic, yarn, llama3).
    factor: float = 1.0
    # Context length the model was pre-trained with (yarn, llama3).
    original_max_position_embeddings: int | None = None
    # Type-specific extras (yarn: beta_fast, beta_slow, mscale, ...; llama3: low/high_freq_factor).
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a decoder-only checkpoint."""

    # HF ``architectures[0]`` (the registry key) and ``model_type``.
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    # Per-head size; may differ from hidden_size // num_attention_heads (Qwen3).
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    # Bias flags as the config states them (an architecture may force its own, e.g. Qwen2).
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    # dtype the checkpoint declares ("float32", "bfloat16", "float16"), None when unstated.
    checkpoint_dtype: str | None = None
    # End-of-sequence ids: generation_config.json's when present, else config.json's.
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # SamplingParams defaults from generation_config.json (see ``generation_defaults``).
    sampling_defaults: dict[str, Any] = field(default_factory=dict, compare=False)
    # The parsed config.json, for architecture-specific fields.
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(
        cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from a parsed config.json (and generation_config.json when given)."""
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        text = cfg.get("text_config")
        if isinstance(text, dict) and "hidden_size" not in cfg:
            cfg = {**text, "architectures": archs}
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
            if k not in cfg
        ]
        if missing:
            raise ValueError(f"config.json lacks required fields: {', '.join(missing)}")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        eos = _int_tuple((generation or {}).get("eos_token_id"))
        if not eos:
            eos = _int_tuple(cfg.get("eos_token_id"))
        return cls(
            architecture=str(archs[0]),
            model_type=str(cfg.get("model_type", "")),
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 4 * hidden)),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope=parse_rope(cfg),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            checkpoint_dtype=_dtype_name(cfg.get("dtype") or cfg.get("torch_dtype")),
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id")
            if isinstance(cfg.get("bos_token_id"), int)
            else None,
            sampling_defaults=generation_defaults(generation or {}),
            raw=cfg,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` and, if present, ``generation_config.json`` from ``path``."""
        p = Path(path)
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(
                f"{p} has no config.json; is it a Hugging Face model directory?"
            )
        cfg = json.loads(cfg_file.read_text())
        gen_file = p / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else None
        return cls.from_dict(cfg, gen)


def parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    """Normalise v4 ``rope_theta`` + ``rope_scaling`` and v5 ``rope_parameters``."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope parameters must be a mapping, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope parameters are not supported by these architectures")
    params = dict(params)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    factor = params.pop("factor", None)
    original = params.pop("original_max_position_embeddings", None)
    if original is None and rope_type in ("yarn", "llama3"):
        original = cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    unknown = set(params) - _ROPE_KEYS[rope_type]
    if unknown:
        raise ValueError(f"unexpected keys for rope type {rope_type!r}: {sorted(unknown)}")
    if rope_type != "default" and factor is None and rope_type != "yarn":
        raise ValueError(f"rope type {rope_type!r} needs a 'factor'")
    if rope_type == "yarn" and factor is None:
        # As transformers: the ratio of the extended to the pre-trained context.
        factor = cfg.get("max_position_embeddings", original) / original
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        partial_rotary_factor=partial,
        factor=float(factor) if factor is not None else 1.0,
        original_max_position_embeddings=int(original) if original is not None else None,
        extra=params,
    )


# generation_config.json keys that map onto SamplingParams fields (HF name -> ours).
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
}
_ALWAYS_KEYS = {"repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(gen: dict[str, Any]) -> dict[str, Any]:
    """The default sampling parameters a checkpoint's generation_config.json asks for.

    transformers' meaning is kept: temperature, top_p, top_k and min_p apply only when
    ``do_sample`` is true (otherwise transformers decodes greedily and ignores them), while
    ``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``) always apply. A value
    that SamplingParams would reject (a negative temperature, a top_p of 0, a string) is
    left out, so a sloppy file never makes every request fail.
    """
    from pagectl.engine.sampling_params import SamplingParams

    keys = dict(_ALWAYS_KEYS)
    if gen.get("do_sample") is True:
        keys.update(_SAMPLING_KEYS)
    out: dict[str, Any] = {}
    for hf_name, name in keys.items():
        value = gen.get(hf_name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        one: dict[str, Any] = {name: value}
        try:
            SamplingParams(**one)
        except (ValueError, TypeError):
            continue
        out[name] = value
    return out


def _int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, bool):
        return ()
    if isinstance(value, int):
        return (value,)
    out: list[int] = []
    for v in value:
        if isinstance(v, int) and not isinstance(v, bool) and v not in out:
            out.append(v)
    return tuple(out)


def _dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    aliases = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16"}
    return aliases.get(name, name)
