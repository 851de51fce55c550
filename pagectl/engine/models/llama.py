"""Llama 2 / 3 (and Mistral-style configs with the same layout): no q/k norm; optional
``attention_bias`` on q, k, v and o and ``mlp_bias`` on the MLP."""

from __future__ import annotations

from pagectl.engine.model_config import ModelConfig
from pagectl.engine.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    architectures = ("LlamaForCausalLM",)

    @classmethod
    def arch_flags(cls, cfg: ModelConfig) -> dict[str, bool]:
        return {
            "qkv_bias": cfg.attention_bias,
            "o_bias": cfg.attention_bias,
            "mlp_bias": cfg.mlp_bias,
            "qk_norm": False,
        }
