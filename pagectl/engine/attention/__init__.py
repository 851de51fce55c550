"""Paged attention backends: torch-native (CPU and CUDA), a compiled CPU kernel for decode
rows, Triton kernels (CUDA; CPU through Triton's interpreter) and flash-attn (CUDA).

``select_backend`` picks one from ``EngineArgs.attention_backend`` (``BACKEND_NAMES``), the
device, the dtype, the block size and the attention shape.
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
    *,
    shape: tuple[int, int, int] | None = None,
) -> AttentionBackend:
    """The attention backend for ``name`` on ``device``; raises ``ValueError`` if impossible.

    ``shape``: (query heads, KV heads, head_dim) on this rank; the triton backend needs it.

    - "torch": the torch-native backend, anywhere;
    - "cpu-kernel": the compiled CPU decode kernel (built on first use); CPU only, float32,
      bfloat16 or float16;
    - "triton": the Triton kernels; CUDA with triton importable, or CPU in Triton's
      interpreter (slow: for tests); any block size, float16/bfloat16/float32, head_dim up
      to 256;
    - "flash": flash-attn; CUDA, a half dtype and (upstream flash-attn's paged kernels) a
      block size that is a multiple of 256;
    - "auto": on CUDA triton when it imports and supports the shape, else flash when all its
      conditions hold, else torch; on CPU the kernel when it builds and passes its
      self-check, else torch. Each fallback reason is logged once per process.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"attention backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}"
        )
    if name == "torch":
        return TorchPagedAttention(device, kv_bytes_per_token=kv_bytes_per_token)
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        triton_backend, why = _triton_backend(device, dtype, shape)
        if triton_backend is not None:
            return triton_backend
        if name == "triton":
            raise ValueError(f"cannot use the triton attention backend: {why}")
        _log_once(f"attention backend auto: not triton ({why})")
    if name == "cpu-kernel" or (name == "auto" and device.type == "cpu"):
        kernel, reason = _cpu_kernel_backend(device, dtype)
        if kernel is not None:
            return kernel
        if name == "cpu-kernel":
            raise ValueError(f"cannot use the cpu-kernel attention backend: {reason}")
        _log_once(f"attention backend auto: {reason}; using the torch backend")
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
        _log_once("attention backend auto: not flash (" + "; ".join(reasons) + "); using torch")
        return TorchPagedAttention(device, kv_bytes_per_token=kv_bytes_per_token)
    from pagectl.engine.attention.flash import FlashPagedAttention

    return FlashPagedAttention(device)


# Per process: the self-check verdict of the loaded kernel (run once), and the fallback
# reasons already logged (one line each, not one per engine).
_kernel_check: list[str | None] = []
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.warning("%s", message)


def _triton_backend(
    device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int] | None
) -> tuple[AttentionBackend | None, str]:
    """The triton backend, or None and why it cannot be used."""
    if shape is None:
        return None, "the attention shape was not given"
    from pagectl.engine.attention.triton_paged import TritonPagedAttention

    try:
        return TritonPagedAttention(device, *shape, dtype), ""
    except ValueError as e:
        return None, str(e).removeprefix("cannot use the triton attention backend: ")


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
