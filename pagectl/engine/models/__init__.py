"""Model registry: checkpoint ``architectures`` names -> our model classes.

Only our own modules are used (never transformers' modeling code); see ``decoder.py``.
"""

from __future__ import annotations

from pagectl.engine.models.decoder import DecoderForCausalLM
from pagectl.engine.models.llama import LlamaForCausalLM
from pagectl.engine.models.qwen2 import Qwen2ForCausalLM
from pagectl.engine.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    name: cls
    for cls in (Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM)
    for name in cls.architectures
}

SUPPORTED_ARCHITECTURES = tuple(sorted(MODEL_REGISTRY))


def get_model_class(architecture: str) -> type[DecoderForCausalLM]:
    """The class serving ``architecture``; ``ValueError`` naming the supported ones otherwise."""
    cls = MODEL_REGISTRY.get(architecture)
    if cls is None:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return cls


__all__ = ["MODEL_REGISTRY", "SUPPORTED_ARCHITECTURES", "DecoderForCausalLM", "get_model_class"]
