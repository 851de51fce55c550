"""Reading quantized checkpoints into the engine's weight names.

The model's loaders see plain tensors only; this module turns a checkpoint's packed
tensors into them, projection by projection:

- AWQ (``version: gemm``, as AutoAWQ writes it): ``qweight`` int32 ``[K, N / 8]`` packs eight
  output features per word in the order ``0 2 4 6 1 3 5 7`` (nibble ``i`` holds feature
  ``8c + AWQ_ORDER[i]``); ``qzeros`` int32 ``[K / G, N / 8]`` the same way; ``scales``
  ``[K / G, N]``; ``w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]``.
- GPTQ (AutoGPTQ / GPTQModel): ``qweight`` int32 ``[K / 8, N]`` packs eight consecutive input
  features per word (nibble ``i`` holds feature ``8r + i``); ``qzeros`` int32 ``[K / G, N / 8]``
  packs output features in order and, in the original (v1) format, stores ``z - 1``;
  ``scales`` ``[K / G, N]``; ``g_idx`` ``[K]`` maps an input feature to its group, which must
  be ``k // G`` (act-order checkpoints that permute groups are refused).

Both become ``PREFIX.weight_int4`` (uint8 ``[N, K]``, values 0..15), ``PREFIX.weight_int4_scale``
and ``PREFIX.weight_int4_zero`` (float32 ``[N, K / 32]``: one entry per 32 input features, a
checkpoint group repeated, so a tensor-parallel rank's slice of input features stays whole
groups), with ``w = (q - 8) * scale + zero`` (``zero = (8 - z) * s``): exactly the checkpoint's
weights in the int4 kernel's form.

- FP8 (``float8_e4m3fn`` weights): ``weight_scale`` (per tensor ``[]``/``[1]`` or per output
  channel ``[N]``/``[N, 1]``) or ``weight_scale_inv`` (per ``weight_block_size`` block) is
  multiplied in, giving ``PREFIX.weight`` in float32. ``input_scale``, ``k_scale`` and ``v_scale``
  (static scales for quantizing activations and the KV cache) are dropped: activations and the
  KV cache stay in the model's float dtype, which is at least as precise.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pagectl.engine.quant.config import QuantConfig

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_IDENTITY_ORDER = tuple(range(8))
# Input features per scale entry in the canonical int4 tensors.
SCALE_SPAN = 32
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
# Activation / KV-cache scales of FP8 checkpoints: not weights (see the module docstring).
_FP8_DROPPED = (".input_scale", ".k_scale", ".v_scale")
_INT4_PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")


class CheckpointTensors:
    """Every tensor of a safetensors checkpoint, by name, read on demand."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self._where: dict[str, Any] = {}
        for file in files:
            handle = safe_open(str(file), framework="pt", device="cpu")
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                self._where[name] = handle

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def slice(self, name: str) -> Any:
        return self._where[name].get_slice(name)

    def tensor(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def dtype_name(self, name: str) -> str:
        return str(self.slice(name).get_dtype())


def unpack_int4_cols(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 ``[R, C / 8]`` -> int ``[R, C]``: nibble ``i`` of word ``c`` is column ``8c + order[i]``."""
    nibbles = (packed.to(torch.int32)[..., None] >> _SHIFTS) & 0xF  # [R, C/8, 8]
    out = torch.empty_like(nibbles)
    out[..., list(order)] = nibbles
    return out.reshape(packed.shape[0], -1)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R / 8, C]`` -> int ``[R, C]``: nibble ``i`` of row ``r`` is row ``8r + i``."""
    nibbles = (packed.to(torch.int32)[:, None, :] >> _SHIFTS[None, :, None]) & 0xF
    return nibbles.reshape(-1, packed.shape[1])


def _canonical_int4(
    q_kn: torch.Tensor, z_gn: torch.Tensor, s_gn: torch.Tensor, group: int, name: str
) -> dict[str, torch.Tensor]:
    k, n = q_kn.shape
    if group == -1:
        group = k
    if k % group or group % SCALE_SPAN or s_gn.shape != (k // group, n) or z_gn.shape != s_gn.shape:
        raise ValueError(
            f"{name}: int4 tensors do not fit together (weight [{k}, {n}], group {group}, "
            f"scales {tuple(s_gn.shape)}, zeros {tuple(z_gn.shape)})"
        )
    s = s_gn.float()
    zero = (8 - z_gn.float()) * s
    rep = group // SCALE_SPAN
    return {
        f"{name}.weight_int4": q_kn.t().to(torch.uint8).contiguous(),
        f"{name}.weight_int4_scale": s.t().repeat_interleave(rep, dim=1).contiguous(),
        f"{name}.weight_int4_zero": zero.t().repeat_interleave(rep, dim=1).contiguous(),
    }


def read_awq(t: CheckpointTensors, name: str, group: int) -> dict[str, torch.Tensor]:
    q = unpack_int4_cols(t.tensor(f"{name}.qweight"), AWQ_ORDER)
    z = unpack_int4_cols(t.tensor(f"{name}.qzeros"), AWQ_ORDER)
    return _canonical_int4(q, z, t.tensor(f"{name}.scales"), group, name)


def read_gptq(t: CheckpointTensors, name: str, group: int, v1: bool) -> dict[str, torch.Tensor]:
    q = unpack_int4_rows(t.tensor(f"{name}.qweight"))
    z = unpack_int4_cols(t.tensor(f"{name}.qzeros"), _IDENTITY_ORDER)
    if v1:
        z = z + 1  # v1 stores z - 1 (kept for compatibility with the original kernels)
    k = q.shape[0]
    if f"{name}.g_idx" in t:
        g_idx = t.tensor(f"{name}.g_idx").long()
        span = k if group == -1 else group
        if not torch.equal(g_idx, torch.arange(k) // span):
            raise ValueError(
                f"{name}: gptq act-order (desc_act) group order is not supported; "
                "re-quantize without desc_act"
            )
    return _canonical_int4(q, z, t.tensor(f"{name}.scales"), group, name)


def dequantize_fp8(t: CheckpointTensors, name: str, block: list[int] | None) -> torch.Tensor:
    """The float32 weight of ``name`` (an FP8 ``...weight``) with its scale applied."""
    w = t.tensor(name).float()
    prefix = name.removesuffix(".weight")
    if f"{prefix}.weight_scale" in t:
        scale = t.tensor(f"{prefix}.weight_scale").float()
        if scale.numel() == 1:
            return w * scale.reshape(())
        if scale.numel() == w.shape[0]:
            return w * scale.reshape(-1, 1)
        raise ValueError(f"{name}: fp8 weight_scale of shape {tuple(scale.shape)} is not supported")
    if f"{prefix}.weight_scale_inv" in t:
        inv = t.tensor(f"{prefix}.weight_scale_inv").float()
        if not block or len(block) != 2:
            raise ValueError(f"{name}: weight_scale_inv needs weight_block_size in the config")
        bn, bk = block
        n, k = w.shape
        if inv.shape != (-(-n // bn), -(-k // bk)):
            raise ValueError(
                f"{name}: weight_scale_inv {tuple(inv.shape)} does not fit blocks {block} of "
                f"a {[n, k]} weight"
            )
        full = inv.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
        return w * full
    raise ValueError(f"{name}: fp8 weight without weight_scale or weight_scale_inv")


def iter_quantized_checkpoint(files: list[Path], quant: QuantConfig) -> Iterator[tuple[str, Any]]:
    """(name, tensor or lazy slice) for the model's loaders, quantized tensors converted.

    A float8 tensor in a checkpoint that does not declare fp8 is refused: it would otherwise
    be read without its scales.
    """
    t = CheckpointTensors(files)
    qc = dict(quant.checkpoint_config)
    method = quant.checkpoint_method
    names = t.names()
    if method in ("awq", "gptq"):
        group = int(qc.get("group_size", qc.get("q_group_size", -1)))
        v1 = str(qc.get("checkpoint_format", "gptq")).lower() == "gptq"
        for name in names:
            if name.endswith(".qweight"):
                prefix = name.removesuffix(".qweight")
                if method == "awq":
                    yield from read_awq(t, prefix, group).items()
                else:
                    yield from read_gptq(t, prefix, group, v1).items()
            elif not name.endswith(_INT4_PARTS):
                yield name, t.slice(name)
        return
    fp8 = method == "fp8"
    block = qc.get("weight_block_size")
    for name in names:
        is_fp8 = t.dtype_name(name) in _FP8_DTYPES
        if is_fp8 and not fp8:
            raise ValueError(
                f"{name} is float8 but config.json declares no fp8 quantization_config: "
                "its scales are unknown, so it cannot be loaded"
            )
        if fp8 and name.endswith((".weight_scale", ".weight_scale_inv", *_FP8_DROPPED)):
            continue
        yield name, (dequantize_fp8(t, name, block) if is_fp8 else t.slice(name))
