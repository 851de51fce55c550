"""The single-stream decode path's shortcuts give bit for bit the values of the general path.

- ``apply_rotary_full`` (four ops) equals ``apply_rotary`` (nine) on strided q/k views;
- ``RotaryEmbedding.cos_sin_full`` holds exactly ``[cos | cos]`` and ``[-sin | sin]`` of
  ``cos_sin``, for the cached tables and for dynamic NTK past the pre-trained length.

(Greedy output against transformers on every architecture: tests/test_models.py.)
"""

from __future__ import annotations

import torch

from pagectl.engine.model_config import RopeConfig
from pagectl.engine.models.rotary import RotaryEmbedding, apply_rotary, apply_rotary_full


def test_full_width_rotation_equals_the_half_width_one_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for t, heads, d in [(1, 12, 64), (7, 24, 128), (5, 3, 16)]:
        qkv = torch.randn(t, heads + 2, d, generator=g) * 10
        x = qkv[:, :heads]  # a view with a row stride, as q/k inside the fused qkv output
        angle = torch.randn(t, 1, d // 2, generator=g) * 100
        cos, sin = angle.cos(), angle.sin()
        want = apply_rotary(x, cos, sin)
        got = apply_rotary_full(x, torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1))
        assert torch.equal(got, want)


def _rope(kind: str, **kw) -> RopeConfig:
    return RopeConfig(rope_type=kind, theta=10000.0, **kw)


def test_full_tables_are_the_half_tables_side_by_side():
    positions = torch.tensor([0, 3, 17, 255])
    for rope, lens in (
        (_rope("default"), None),
        (_rope("dynamic", factor=2.0), torch.tensor([300, 300, 600, 600])),
    ):
        emb = RotaryEmbedding(32, rope, 256)
        emb.ensure_cache(256)
        cos, sin = emb.cos_sin(positions, torch.float32, lens)
        cos_full, sin_full = emb.cos_sin_full(positions, torch.float32, lens)
        assert cos_full.shape == (4, 1, 32)
        assert torch.equal(cos_full, torch.cat([cos, cos], -1))
        assert torch.equal(sin_full, torch.cat([-sin, sin], -1))
