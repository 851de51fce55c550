"""Qwen3: RMSNorm on each q and k head before the rotation; ``attention_bias`` on q, k, v
and o; head_dim is usually not hidden_size / num_attention_heads."""

from __future__ import annotations

from pagectl.engine.model_config import ModelConfig
from pagectl.engine.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen3ForCausalLM",)

    @classmethod
    def arch_flags(cls, cfg: ModelConfig) -> dict[str, bool]:
        return {
            "qkv_bias": cfg.attention_bias,
            "o_bias": cfg.attention_bias,
            "mlp_bias": False,
            "qk_norm": True,
        }
