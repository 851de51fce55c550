"""Paged attention backends: torch-native (CPU and CUDA) and flash-attn (CUDA).

``select_backend`` picks one from ``EngineArgs.attention_backend`` ("auto", "torch",
"flash"), the device and the block size.
"""

from __future__ import annotations

import torch

from pagectl.engine.attention.backend import AttentionBackend
from pagectl.engine.attention.metadata import AttentionMetadata
from pagectl.engine.attention.torch_paged import TorchPagedAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchPagedAttention", "select_backend"]


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(
    name: str,
    device: torch.device,
    block_size: int,
    dtype: torch.dtype,
    kv_bytes_per_token: int | None = None,
) -> AttentionBackend:
    """The attention backend for ``name`` on ``device``; raises ``ValueError`` if impossible.

    flash-attn needs CUDA, a half dtype and (upstream flash-attn's paged kernels) a block size
    that is a multiple of 256; "auto" falls back to the torch backend when any is missing.
    """
    if name not in ("auto", "torch", "flash"):
        raise ValueError(f"attention backend must be auto, torch or flash, got {name!r}")
    if name == "torch":
        return TorchPagedAttention(device, kv_bytes_per_token=kv_bytes_per_token)
    reasons = []
    if device.type != "cuda":
        reasons.append(f"device is {device.type}, not cuda")
    if dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"dtype is {dtype}, flash-attn needs float16 or bfloat16")
    if block_size % 256:
        reasons.append(
            f"block_size is {block_size}, flash-attn's paged kernels need a multiple of 256"
        )
    if not reasons and not flash_attn_available():
        reasons.append("flash_attn is not installed")
    if reasons:
        if name == "flash":
            raise ValueError("cannot use the flash attention backend: " + "; ".join(reasons))
        return TorchPagedAttention(device, kv_bytes_per_token=kv_bytes_per_token)
    from pagectl.engine.attention.flash import FlashPagedAttention

    return FlashPagedAttention(device)
