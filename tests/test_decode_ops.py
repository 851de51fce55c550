"""The single-stream decode path's shortcuts give bit for bit the values of the general path.

- ``apply_rotary_full`` (four ops) equals ``apply_rotary`` (nine) on strided q/k views;
- ``RotaryEmbedding.cos_sin_full`` holds exactly ``[cos | cos]`` and ``[-sin | sin]`` of
  ``cos_sin``, for the cached tables and for dynamic NTK past the pre-trained length;
- the fused CPU ops (add + RMSNorm, q/k norm + rotary, SiLU-and-mul) equal the torch path
  within float rounding (bfloat16: within its rounding), and a loaded CPU model uses them
  where they apply (float32 and bfloat16; the rotation only when it covers whole heads).

(Greedy output against transformers on every architecture: tests/test_models.py.)
"""

from __future__ import annotations

import pytest
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


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_full_tables_are_the_half_tables_side_by_side(partial):
    # The embedding caches one pair (full width when the whole head turns, else half width)
    # and derives the other: both must hold the same values either way.
    positions = torch.tensor([0, 3, 17, 255])
    width = int(32 * partial)
    for rope, lens in (
        (_rope("default", partial_rotary_factor=partial), None),
        (
            _rope("dynamic", factor=2.0, partial_rotary_factor=partial),
            torch.tensor([300, 300, 600, 600]),
        ),
    ):
        emb = RotaryEmbedding(32, rope, 256)
        emb.ensure_cache(256)
        cos, sin = emb.cos_sin(positions, torch.float32, lens)
        cos_full, sin_full = emb.cos_sin_full(positions, torch.float32, lens)
        assert cos.shape == (4, 1, width // 2) and cos_full.shape == (4, 1, width)
        assert torch.equal(cos_full, torch.cat([cos, cos], -1))
        assert torch.equal(sin_full, torch.cat([-sin, sin], -1))
        # The fused op's rows: the same values, contiguous [T, width].
        cos_rows, sin_rows = emb.cos_sin_full(positions, torch.float32, lens, head_axis=False)
        assert cos_rows.shape == (4, width) and cos_rows.is_contiguous()
        assert torch.equal(cos_rows, cos_full[:, 0]) and torch.equal(sin_rows, sin_full[:, 0])
        cos_bf16, _ = emb.cos_sin(positions, torch.bfloat16, lens)
        assert torch.equal(cos_bf16, cos.to(torch.bfloat16))


# -- the fused CPU ops (attention/csrc/decode_ops_cpu.cpp) ----------------------------------


def _ops():
    from pagectl.engine.attention import cpu_build

    ops = cpu_build.load_cpu_ops()
    assert ops is not None, f"the CPU kernels did not build: {cpu_build.failure_reason()}"
    return ops


# Decode-sized rows (one thread) and a prefill-sized batch (rows split among threads).
_ROWS = (1, 3, 200)


def test_fused_add_rms_norm_equals_the_torch_path():
    from pagectl.engine.models.layers import RMSNorm

    ops = _ops()
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for t, h in [(r, w) for r in _ROWS for w in (64, 520)]:
            norm = RMSNorm(h, 1e-6, dtype)
            norm.weight.data.copy_(torch.randn(h, generator=g))
            x = torch.randn(t, h, generator=g).to(dtype)
            res = torch.randn(t, h, generator=g).to(dtype)
            want_out, want_res = norm(x.clone(), res.clone())  # the torch path
            norm.use_cpu_ops(ops)
            x2, res2 = x.clone(), res.clone()
            out, new_res = norm(x2, res2)
            assert out.data_ptr() == x2.data_ptr() and new_res.data_ptr() == res2.data_ptr()
            assert torch.equal(new_res, want_res)  # the sum, rounded to the dtype
            torch.testing.assert_close(out.float(), want_out.float(), rtol=tol, atol=tol)


def test_fused_qk_norm_and_rotary_equal_the_torch_path():
    ops = _ops()
    g = torch.Generator().manual_seed(1)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        for t in _ROWS:
            heads, kv, d = 6, 2, 64
            qkv = torch.randn(t, (heads + 2 * kv) * d, generator=g).to(dtype)
            angle = torch.randn(t, 1, d // 2, generator=g) * 50
            cos = torch.cat([angle.cos()] * 2, -1).to(dtype)
            sin = torch.cat([-angle.sin(), angle.sin()], -1).to(dtype)
            weight = torch.randn(heads + kv, d, generator=g).to(dtype)
            for w in (weight, None):
                qk = qkv[:, : (heads + kv) * d].view(t, heads + kv, d)
                if w is not None:
                    xf = qk.float()
                    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
                    qk = w * xf.to(dtype)
                want = apply_rotary_full(qk, cos, sin)
                got = qkv.clone()
                ops.qk_norm_rope_(got, heads + kv, d, w, 1e-6, cos.view(t, d), sin.view(t, d))
                got_qk = got[:, : (heads + kv) * d].view(t, heads + kv, d)
                torch.testing.assert_close(got_qk.float(), want.float(), rtol=tol, atol=tol)
                # v (after the q and k heads) is left alone
                assert torch.equal(got[:, (heads + kv) * d :], qkv[:, (heads + kv) * d :])


def test_fused_silu_and_mul_equals_the_torch_path():
    ops = _ops()
    g = torch.Generator().manual_seed(2)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        for t, d in [(r, w) for r in _ROWS for w in (8, 100, 1536)]:
            x = (torch.randn(t, 2 * d, generator=g) * 8).to(dtype)
            x[0, 0] = -100.0  # far in both tails: silu -> -0 and -> x
            x[0, 1] = 100.0
            want = torch.nn.functional.silu(x[:, :d]) * x[:, d:]
            torch.testing.assert_close(ops.silu_and_mul(x), want, rtol=tol, atol=tol)


def test_fused_ops_refuse_what_they_cannot_take():
    ops = _ops()
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.add_rms_norm_(x, torch.randn(2, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.add_rms_norm_(x, torch.randn(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="heads"):
        ops.qk_norm_rope_(x, 2, 8, None, 1e-6, torch.ones(2, 8), torch.ones(2, 8))
    with pytest.raises(RuntimeError, match="2d"):
        ops.silu_and_mul(torch.randn(2, 7))


def test_a_loaded_cpu_model_uses_the_fused_ops(tmp_path):
    from pagectl.engine.args import EngineArgs
    from pagectl.engine.builder import build_engine
    from pagectl.engine.models.decoder import DecoderAttention
    from pagectl.engine.models.layers import RMSNorm, SiluAndMul
    from tests.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path / "m", "qwen3", with_tokenizer=False)
    model = build_engine(EngineArgs(model=str(path), num_kv_blocks=8)).core.executor.model
    fused = [m for m in model.modules() if isinstance(m, (RMSNorm, SiluAndMul, DecoderAttention))]
    assert fused and all(m.fused_op is not None for m in fused)
    assert model._fused_rotary


@pytest.mark.parametrize(
    ("dtype", "partial", "norms", "rotary"),
    [
        (torch.float32, 1.0, True, True),
        (torch.bfloat16, 1.0, True, True),
        # The op rotates whole heads only: partial rotary keeps the torch rotation.
        (torch.float32, 0.5, True, False),
        # The ops compute float32 and bfloat16 only: float16 keeps the torch path throughout.
        (torch.float16, 1.0, False, False),
    ],
)
def test_the_fused_ops_are_chosen_by_dtype_and_rotary_width(
    tmp_path, dtype, partial, norms, rotary
):
    from pagectl.engine.loader import load_model
    from pagectl.engine.model_config import ModelConfig
    from pagectl.engine.models.layers import RMSNorm, SiluAndMul
    from tests.tiny_models import build_tiny_model

    path = build_tiny_model(
        tmp_path / "m",
        "qwen3",
        with_tokenizer=False,
        config_overrides={"partial_rotary_factor": partial},
    )
    cfg = ModelConfig.from_dir(path)
    assert cfg.rope.partial_rotary_factor == partial
    model = load_model(path, cfg, dtype, torch.device("cpu"))
    _ops()
    model.pack_for_cpu()
    elementwise = [m for m in model.modules() if isinstance(m, (RMSNorm, SiluAndMul))]
    assert elementwise and all((m.fused_op is not None) == norms for m in elementwise)
    assert all((a.fused_op is not None) == rotary for a in model.attention_layers)
    assert model._fused_rotary == rotary
