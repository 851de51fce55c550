"""Qwen2 / Qwen2.5: bias on q, k and v (always), none on o or the MLP."""

from __future__ import annotations

from pagectl.engine.model_config import ModelConfig
from pagectl.engine.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen2ForCausalLM",)

    @classmethod
    def arch_flags(cls, cfg: ModelConfig) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False, "mlp_bias": False, "qk_norm": False}
