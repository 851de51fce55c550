"""Paged attention backends: torch-native (CPU and CUDA), a compiled CPU kernel for decode
rows, and flash-attn (CUDA).

``select_backend`` picks one from ``EngineArgs.attention_backend`` (``BACKEND_NAMES``), the
device, the dtype and the block size.
"""

from __future__ import annotations

import logging

import torch

from pagectl.engine.args import ATTENTION_BACKENDS as BACKEND_NAMES
from pagectl.engine.attention.backend import AttentionBackend
from pagectl.engine.attention.metadata import AttentionMetadata
from pagectl.engine.attention.torch_paged import TorchPagedAttention

__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "TorchPagedAttention",
    "select_backend",
]

log = logging.getLogger(__name__)


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

    - "torch": the torch-native backend, anywhere;
    - "cpu-kernel": the compiled CPU decode kernel (built on first use); CPU only, float32,
      bfloat16 or float16;
    - "flash": flash-attn; CUDA, a half dtype and (upstream flash-attn's paged kernels) a
      block size that is a multiple of 256;
    - "auto": flash when all its conditions hold, else on CPU the kernel when it builds and
      passes its self-check (one log line when it does not), else the torch backend.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"attention backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}"
        )
    if name == "torch":
        return TorchPagedAttention(device, kv_bytes_per_token=kv_bytes_per_token)
    if name == "cpu-kernel" or (name == "auto" and device.type == "cpu"):
        kernel, reason = _cpu_kernel_backend(device, dtype)
        if kernel is not None:
            return kernel
        if name == "cpu-kernel":
            raise ValueError(f"cannot use the cpu-kernel attention backend: {reason}")
        if reason not in _logged:
            _logged.add(reason)
            log.warning("attention backend auto: %s; using the torch backend", reason)
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


# Per process: the self-check verdict of the loaded kernel (run once), and the fallback
# reasons already logged (one line each, not one per engine).
_kernel_check: list[str | None] = []
_logged: set[str] = set()


def _cpu_kernel_backend(
    device: torch.device, dtype: torch.dtype
) -> tuple[AttentionBackend | None, str]:
    """The CPU kernel backend, or None and why it cannot be used."""
    from pagectl.engine.attention import cpu_build
    from pagectl.engine.attention.cpu_kernel import (
        SUPPORTED_DTYPES,
        CpuKernelPagedAttention,
        self_check,
    )

    if device.type != "cpu":
        return None, f"device is {device.type}, the kernel runs on cpu"
    if dtype not in SUPPORTED_DTYPES:
        return None, f"dtype {dtype} is not supported by the kernel"
    ops = cpu_build.load_cpu_ops()
    if ops is None:
        return None, f"the CPU kernel is unavailable ({cpu_build.failure_reason()})"
    if not _kernel_check:
        _kernel_check.append(self_check(ops))
    if _kernel_check[0] is not None:
        return None, _kernel_check[0]
    return CpuKernelPagedAttention(device, ops), ""
