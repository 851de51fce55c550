"""Quantized checkpoints written from a float tiny model, following each format's published
layout (AutoAWQ's GEMM packing, AutoGPTQ's v1 packing, FP8 with per-tensor or block scales),
plus the float checkpoint of the weights they stand for (the dequantized reference).

The packers here are written from the formats' descriptions, independently of the engine's
readers (pagectl/engine/quant/checkpoint.py), so a layout mistake in either shows up.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds column 8c + order[i]


def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and any(f".{p}." in name for p in PROJECTIONS)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_cols(v: torch.Tensor, order: list[int]) -> torch.Tensor:
    """int [R, C] (0..15) -> int32 [R, C / 8]; word c, nibble i = column 8c + order[i]."""
    r, c = v.shape
    words = torch.zeros(r, c // 8, dtype=torch.int64)
    for i, j in enumerate(order):
        words |= v[:, j::8].long() << (4 * i)
    return _to_int32(words)


def pack_rows(v: torch.Tensor) -> torch.Tensor:
    """int [R, C] (0..15) -> int32 [R / 8, C]; row r, nibble i = row 8r + i."""
    r, c = v.shape
    words = torch.zeros(r // 8, c, dtype=torch.int64)
    for i in range(8):
        words |= v[i::8].long() << (4 * i)
    return _to_int32(words)


def quantize_asym(w: torch.Tensor, group: int, zero_min: int = 0):
    """w [N, K] -> (q [K, N], z [K/G, N], s [K/G, N] float16, dequantized w [N, K]), with
    integer zero points in [zero_min, 15]."""
    n, k = w.shape
    wt = w.t().reshape(k // group, group, n)
    lo, hi = wt.amin(1), wt.amax(1)
    s = ((hi - lo) / 15).clamp(min=1e-4).half()
    sf = s.float()
    z = torch.round(-lo / sf).clamp(zero_min, 15)
    q = torch.clamp(torch.round(wt / sf[:, None]) + z[:, None], 0, 15)
    deq = ((q - z[:, None]) * sf[:, None]).reshape(k, n).t().contiguous()
    return q.reshape(k, n).long(), z.long(), s, deq


def _write(src: Path, dst: Path, tensors: dict, quantization_config: dict | None) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def write_int4(src: Path, out: Path, method: str, group: int = 32) -> tuple[Path, Path]:
    """An AWQ ("awq") or GPTQ ("gptq", v1, with g_idx) checkpoint of ``src``'s weights and
    the float checkpoint of its dequantized weights. Returns (quantized dir, reference dir)."""
    float_weights = load_file(str(src / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, w in float_weights.items():
        if not _is_projection(name):
            packed[name] = reference[name] = w
            continue
        prefix = name.removesuffix(".weight")
        # GPTQ v1 stores z - 1, so its zero points start at 1.
        q, z, s, deq = quantize_asym(w, group, zero_min=1 if method == "gptq" else 0)
        reference[name] = deq
        packed[f"{prefix}.scales"] = s
        if method == "awq":
            packed[f"{prefix}.qweight"] = pack_cols(q, AWQ_PACK_ORDER)
            packed[f"{prefix}.qzeros"] = pack_cols(z, AWQ_PACK_ORDER)
        else:
            packed[f"{prefix}.qweight"] = pack_rows(q)
            packed[f"{prefix}.qzeros"] = pack_cols(z - 1, list(range(8)))
            k = w.shape[1]
            packed[f"{prefix}.g_idx"] = (torch.arange(k) // group).to(torch.int32)
    if method == "awq":
        qc = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
        }
    else:
        qc = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": False,
            "sym": False,
            "checkpoint_format": "gptq",
        }
    qdir = _write(src, out / method, packed, qc)
    rdir = _write(src, out / f"{method}-reference", reference, None)
    return qdir, rdir


def write_fp8(src: Path, out: Path, scheme: str) -> tuple[Path, Path]:
    """An FP8 checkpoint of ``src``: "tensor" (one ``weight_scale`` per weight, plus an
    ``input_scale``) or "block" (``weight_scale_inv`` per 32x32 block). Returns (fp8 dir,
    float reference dir holding fp8 values times their scales)."""
    float_weights = load_file(str(src / "model.safetensors"))
    fp8: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    fmax = torch.finfo(torch.float8_e4m3fn).max
    bn = bk = 32
    for name, w in float_weights.items():
        if not _is_projection(name):
            fp8[name] = reference[name] = w
            continue
        prefix = name.removesuffix(".weight")
        if scheme == "tensor":
            scale = w.abs().amax() / fmax
            w8 = (w / scale).to(torch.float8_e4m3fn)
            fp8[f"{prefix}.weight_scale"] = scale.reshape(())
            fp8[f"{prefix}.input_scale"] = torch.tensor(1.0)
            reference[name] = w8.float() * scale
        else:
            n, k = w.shape
            blocks = w.reshape(n // bn, bn, k // bk, bk)
            inv = blocks.abs().amax(dim=(1, 3)) / fmax
            full = inv.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            w8 = (w / full).to(torch.float8_e4m3fn)
            fp8[f"{prefix}.weight_scale_inv"] = inv
            reference[name] = w8.float() * full
        fp8[name] = w8
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if scheme == "block":
        qc["weight_block_size"] = [bn, bk]
    qdir = _write(src, out / f"fp8-{scheme}", fp8, qc)
    rdir = _write(src, out / f"fp8-{scheme}-reference", reference, None)
    return qdir, rdir
