"""Which weight quantization a model is loaded with: the request and the checkpoint's own.

Two sources, reconciled once before any weight is read:

- ``--quantization int8|int4`` (``EngineArgs.quantization``): weight-only quantization made at
  load time from a float checkpoint (or from an FP8 one after its scales are applied).
- the checkpoint's ``config.json`` ``quantization_config.quant_method``: ``awq`` and ``gptq``
  (4-bit) load into the int4 path; ``fp8`` weights are multiplied by their ``weight_scale``
  (or block ``weight_scale_inv``) into float at load. Any other method is refused by name:
  a quantized checkpoint is never read as if its tensors were float weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Values of ``--quantization`` (None: follow the checkpoint).
QUANTIZATION_METHODS = ("int8", "int4")
# Checkpoint ``quant_method`` values that load.
CHECKPOINT_METHODS = ("awq", "gptq", "fp8")
# Group size of load-time int4 (the largest kernel group that divides a layer's input features
# is used when this one does not).
DEFAULT_INT4_GROUP_SIZE = 128


@dataclass(frozen=True)
class QuantConfig:
    """How a model's matmul weights are stored and multiplied."""

    # "int8" (per output channel, symmetric) or "int4" (group-wise, asymmetric), or None: float.
    method: str | None = None
    # The checkpoint's quant_method ("awq", "gptq", "fp8") or None for a float checkpoint.
    checkpoint_method: str | None = None
    # int4: input features per scale group made at load time (checkpoint int4 keeps its own).
    group_size: int = DEFAULT_INT4_GROUP_SIZE
    # The checkpoint's quantization_config (format details the checkpoint reader needs).
    checkpoint_config: tuple[tuple[str, Any], ...] = ()

    @property
    def checkpoint_int4(self) -> bool:
        """True when the checkpoint holds packed 4-bit weights (AWQ, GPTQ)."""
        return self.checkpoint_method in ("awq", "gptq")

    def describe(self) -> str:
        """'int4 (awq checkpoint)', 'int8', 'float (fp8 checkpoint)', 'float'."""
        what = self.method or "float"
        return f"{what} ({self.checkpoint_method} checkpoint)" if self.checkpoint_method else what


def _checkpoint_method(raw_config: dict) -> tuple[str | None, dict]:
    qc = raw_config.get("quantization_config")
    if qc is None:
        return None, {}
    if not isinstance(qc, dict):
        raise ValueError(f"config.json quantization_config must be an object, got {qc!r}")
    method = str(qc.get("quant_method", "")).lower() or None
    if method is None:
        raise ValueError("config.json has a quantization_config without a quant_method")
    return method, qc


def _check_int4_format(method: str, qc: dict) -> None:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} checkpoints with {bits} bits are not supported (only 4-bit)")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or (group != -1 and (group <= 0 or group % 32)):
        raise ValueError(
            f"{method} group_size {group!r} is not supported (a multiple of 32, or -1)"
        )
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq version {version!r} is not supported (only 'gemm')")
        if not qc.get("zero_point", True):
            raise ValueError("awq checkpoints without zero points are not supported")
    else:
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported")


def _check_fp8_format(qc: dict) -> None:
    fmt = qc.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise ValueError(f"fp8 checkpoints in format {fmt!r} are not supported (only e4m3)")


def resolve_quantization(
    requested: str | None, raw_config: dict, device_type: str, int4_group_size: int | None = None
) -> QuantConfig:
    """The QuantConfig for ``--quantization requested`` and the checkpoint's config.

    Raises ``ValueError`` naming the method for anything that cannot load correctly.
    """
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {requested!r}"
        )
    ckpt, qc = _checkpoint_method(raw_config)
    if ckpt is not None and ckpt not in CHECKPOINT_METHODS:
        raise ValueError(
            f"checkpoint quantization method {ckpt!r} is not supported (supported: "
            f"{', '.join(CHECKPOINT_METHODS)}); it cannot be loaded as float weights"
        )
    method = requested
    if ckpt in ("awq", "gptq"):
        _check_int4_format(ckpt, qc)
        if requested not in (None, "int4"):
            raise ValueError(
                f"the checkpoint is {ckpt} int4; --quantization {requested} cannot re-quantize it"
            )
        method = "int4"
    elif ckpt == "fp8":
        _check_fp8_format(qc)
    if method is not None and device_type != "cpu":
        what = f"{ckpt} checkpoints" if ckpt in ("awq", "gptq") else f"--quantization {method}"
        raise ValueError(
            f"{what} run on CPU only (the int8/int4 kernels used are torch's CPU ones)"
        )
    group = int4_group_size or DEFAULT_INT4_GROUP_SIZE
    return QuantConfig(method, ckpt, group, tuple(sorted(qc.items())))
