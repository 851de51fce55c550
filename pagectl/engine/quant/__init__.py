"""Weight-only quantization: the configuration (``config``), torch's CPU int8/int4 kernels
(``kernels``) and quantized checkpoint formats (``checkpoint``: AWQ, GPTQ, FP8)."""

from pagectl.engine.quant.config import QUANTIZATION_METHODS, QuantConfig, resolve_quantization

__all__ = ["QUANTIZATION_METHODS", "QuantConfig", "resolve_quantization"]
