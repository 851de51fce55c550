"""EngineArgs: every start-up option of the engine, shared by ``LLM``, the CLI and the daemon.

Names follow vLLM's where the meaning is the same, so operators bring their habits along.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields

DTYPES = ("auto", "float32", "bfloat16", "float16")
# Weight-only quantization made at load time (pagectl/engine/quant).
QUANTIZATIONS = ("int8", "int4")
# Attention backends (see pagectl/engine/attention/__init__.py: select_backend).
ATTENTION_BACKENDS = ("auto", "torch", "cpu-kernel", "flash")
GENERATION_CONFIG_MODES = ("auto", "none")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_size(value: str | int | float) -> int:
    """'4GiB' -> 4294967296, '512MB' -> 512000000, 1024 -> 1024."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"size must be positive, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r} (examples: 4GiB, 512MiB, 2GB, 1073741824)")
    size = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size


@dataclass
class EngineArgs:
    """Start-up options. ``model=None`` serves the built-in model shipped with the package."""

    # Hugging Face model directory or hub id; None: the built-in model.
    model: str | None = None
    # Tokenizer directory or hub id (default: the model's).
    tokenizer: str | None = None
    # Name the API reports and accepts (default: the model path / id).
    served_model_name: str | None = None
    # "auto" follows the checkpoint (float32 on CPU when the checkpoint is half precision).
    dtype: str = "auto"
    # "auto": cuda when available, else cpu.
    device: str = "auto"
    # Weight-only quantization made at load time from a float checkpoint (CPU): "int8" (per
    # output channel) or "int4" (groups of 128 input features); None: as the checkpoint
    # (AWQ/GPTQ load as int4, FP8 with its scales applied, anything else refused by name).
    quantization: str | None = None
    tensor_parallel_size: int = 1
    block_size: int = 16
    # KV pool size: an exact block count, or a memory budget, or (CUDA) a fraction of memory.
    num_kv_blocks: int | None = None
    kv_cache_memory: str | int | None = None
    gpu_memory_utilization: float = 0.9
    # Token budget per step (default: 2048 on CPU, 8192 on CUDA).
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    # Longest prompt + output (default: the model's max_position_embeddings, capped by the pool).
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    # CUDA only: disable CUDA graphs.
    enforce_eager: bool = False
    # Global seed for unseeded sampling.
    seed: int = 0
    # CPU threads for torch (default: torch's own choice).
    num_threads: int | None = None
    # Attention backend: "auto", "torch", "cpu-kernel" (compiled on first use) or "flash"
    # (CUDA with flash-attn importable); "auto" picks flash, else the CPU kernel, else torch.
    attention_backend: str = "auto"
    # Default sampling parameters: "auto" takes them from the model's generation_config.json
    # (temperature, top_p, top_k, min_p when it sets do_sample; repetition_penalty;
    # max_new_tokens as max_tokens), "none" keeps the engine's own (OpenAI's) defaults.
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )

        if self.generation_config not in GENERATION_CONFIG_MODES:
            raise ValueError(
                f"generation_config must be one of {', '.join(GENERATION_CONFIG_MODES)}, "
                f"got {self.generation_config!r}"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
