"""The packed matmul (``csrc/packed_linear_cpu.cpp``): bfloat16 on CPUs with AVX512-BF16,
float32 and int8 on AVX-512 CPUs. The layouts ``pack_weight`` writes, the op's result against a
float64 reference, the layers that take it (and those that keep the plain weight), and a
tied LM head whose embedding gathers its rows from the packed copy. Each packed case is
skipped where the library has no such kernel: there the plain kernels run (test_quant.py),
as they do anywhere when a layer declines the packed layout (the last case)."""

from __future__ import annotations

import pytest
import torch

from pagectl.engine.attention import cpu_build
from pagectl.engine.models.embedding import ParallelLMHead, VocabParallelEmbedding
from pagectl.engine.models.linear import ColumnParallelLinear, RowParallelLinear

DTYPES = [torch.bfloat16, torch.float32]


def _ops(dtype=torch.bfloat16):
    ops = cpu_build.load_cpu_ops()
    assert ops is not None, "the CPU kernels did not build"
    if not ops.packed_linear_available(dtype):
        pytest.skip(f"this CPU has no packed {dtype} kernel (AVX-512, AVX512-BF16)")
    return ops


def _close(got: torch.Tensor, want: torch.Tensor, k: int) -> bool:
    """Within one step of the output dtype (bfloat16: 2^-8 relative; float32: the sum's
    rounding) of the float64 value, plus float32 summation error over k products."""
    rel = 2.0**-8 if got.dtype == torch.bfloat16 else 2.0**-20
    err = (got.double() - want).abs()
    return bool((err <= want.abs() * rel + 1e-5 * k).all())


def test_pack_lays_out_steps_of_64_features():
    ops = _ops()
    n, k = 128, 24
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k).bfloat16()
    p = ops.pack_weight(w)
    assert p.shape == (n // 64, k // 2, 64, 2) and p.dtype == torch.bfloat16
    for t, pair, col, half in [(0, 0, 0, 0), (1, 5, 17, 1), (0, 11, 63, 0), (1, 0, 0, 1)]:
        assert torch.equal(p[t, pair, col, half], w[64 * t + col, 2 * pair + half])
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ops.pack_weight(torch.zeros(96, 16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16, float32 or int8"):
        ops.pack_weight(torch.zeros(64, 16, dtype=torch.float16))


def test_pack_lays_out_float32_features_of_64_outputs():
    ops = _ops(torch.float32)
    w = torch.arange(128 * 16, dtype=torch.float32).reshape(128, 16)
    p = ops.pack_weight(w)
    assert p.shape == (2, 16, 64) and p.dtype == torch.float32
    for t, kk, col in [(0, 0, 0), (1, 5, 17), (0, 15, 63)]:
        assert p[t, kk, col] == w[64 * t + col, kk]


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_matmul_rounds_the_float32_sum_once(dtype):
    """Every row-count shape of the kernel: one row, a partial pass of 2-5 rows, whole
    passes of 6, and more rows than one block of x keeps in L2 (K = 3072 in bfloat16: 30
    rows a block)."""
    ops = _ops(dtype)
    torch.manual_seed(0)
    for m, n, k in [
        (1, 64, 8),
        (1, 192, 1032),
        (2, 64, 40),
        (5, 128, 136),
        (6, 64, 64),
        (13, 256, 1024),
        (31, 64, 3072),
        (100, 320, 3072),
        (257, 128, 1024),
    ]:
        x = torch.randn(m, k).to(dtype)
        w = torch.randn(n, k).to(dtype)
        scale, bias = torch.rand(n) + 0.5, torch.randn(n)
        packed = ops.pack_weight(w)
        exact = x.double() @ w.double().t()
        for s, b, want in ((None, None, exact), (scale, bias, exact * scale.double() + bias)):
            got = ops.skinny_linear(x, packed, s, b)
            assert got.dtype == dtype and got.shape == (m, n)
            assert _close(got, want, k), (m, n, k)
    packed = ops.pack_weight(torch.randn(64, 32).to(dtype))
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(RuntimeError, match="its own dtype"):
        ops.skinny_linear(torch.randn(2, 32).to(other), packed, None, None)
    with pytest.raises(RuntimeError, match="input features"):
        ops.skinny_linear(torch.randn(2, 16).to(dtype), packed, None, None)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_packed_int8_applies_its_scale_to_the_float32_sum(x_dtype):
    """int8 weights (exact in float32) times float32 or bfloat16 x: the float32 sum times
    each output's scale, in x's dtype; the layout is float32's ([N / 64, K, 64])."""
    ops = _ops(torch.int8)
    torch.manual_seed(3)
    for m, n, k in [(1, 64, 8), (1, 128, 1032), (4, 64, 136), (13, 192, 1024), (70, 64, 520)]:
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scale = torch.rand(n) / 50
        packed = ops.pack_weight(q)
        assert packed.shape == (n // 64, k, 64) and torch.equal(packed[0, :, 5], q[5])
        x = torch.randn(m, k).to(x_dtype)
        want = x.double() @ (q.double() * scale.double()[:, None]).t()
        got = ops.skinny_linear(x, packed, scale, None)
        assert got.dtype == x_dtype and _close(got, want, k), (m, n, k)
    with pytest.raises(RuntimeError, match="needs its scale"):
        ops.skinny_linear(torch.randn(2, 8), ops.pack_weight(q[:, :8]), None, None)


def test_int8_weight_packs_and_dequantizes_to_its_plain_values():
    from pagectl.engine.quant.kernels import Int8Weight

    _ops(torch.int8)
    torch.manual_seed(4)
    w = torch.randn(128, 96)
    q8 = Int8Weight.quantize(w)
    assert q8.is_packed and q8.q.shape == (2, 96, 64)
    plain = torch.round(w / (w.abs().amax(1) / 127).clamp(min=1e-12)[:, None]).to(torch.int8)
    assert torch.equal(q8.plain(), plain)
    x = torch.randn(5, 96)
    torch.testing.assert_close(q8.matmul(x), x @ q8.dequantize().t(), rtol=1e-5, atol=1e-4)
    # 80 outputs: not whole tiles, the plain layout stays.
    assert not Int8Weight.quantize(torch.randn(80, 96)).is_packed


@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_take_the_packed_weight_where_it_fits(dtype):
    _ops(dtype)
    torch.manual_seed(1)
    col = ColumnParallelLinear(96, 128, bias=True, params_dtype=dtype)
    col.weight.data.copy_(torch.randn(128, 96))
    col.bias.data.copy_(torch.randn(128))
    w, b = col.weight.data.clone(), col.bias.data.clone()
    assert col.pack_for_cpu()
    assert col._own_packed is not None and col.weight.numel() == 0  # one copy only
    weight, scale, bias = col.kernel_operands()
    assert weight is col._own_packed and scale is None and bias is col.bias
    for rows in (1, 7, 300):  # 300: past DENSE_MIN_ROWS, still the packed kernel
        x = torch.randn(rows, 96).to(dtype)
        want = x.double() @ w.double().t() + b.double()
        assert _close(col(x), want, 96), rows
    # 3-D activations keep their shape.
    assert col(torch.randn(2, 3, 96).to(dtype)).shape == (2, 3, 128)
    # 80 output features: not whole tiles of 64, so another path (the plain kernel, or
    # oneDNN's packed layout for bfloat16 where it takes it), with the same result.
    odd = RowParallelLinear(64, 80, params_dtype=dtype)
    odd.weight.data.copy_(torch.randn(80, 64))
    w = odd.weight.data.clone()
    assert odd.pack_for_cpu() and odd._own_packed is None
    x = torch.randn(4, 64).to(dtype)
    want = x.double() @ w.double().t()
    assert bool(((odd(x).double() - want).abs() <= want.abs() * 2.0**-7 + 1e-3).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tied_head_packs_once_and_its_embedding_reads_the_packed_rows(dtype):
    _ops(dtype)
    torch.manual_seed(2)
    vocab, dim = 192, 48
    emb = VocabParallelEmbedding(vocab, dim, params_dtype=dtype)
    emb.weight.data.copy_(torch.randn(vocab, dim))
    head = ParallelLMHead(vocab, dim, params_dtype=dtype)
    head.tie(emb)
    rows = emb.weight.data.clone()
    assert head.pack_for_cpu()
    assert emb.weight.numel() == 0 and emb._packed_rows is head._own_packed
    ids = torch.tensor([[0, 63, 64, 191], [5, 130, 5, 2]])
    assert torch.equal(emb(ids), rows[ids])
    hidden = torch.randn(3, dim).to(dtype)
    want = hidden.double() @ rows.double().t()
    got = head.compute_logits(hidden)
    assert got.dtype == torch.float32
    assert _close(got.to(dtype), want, dim)


@pytest.mark.parametrize("dtype", DTYPES)
def test_declining_the_packed_layout_keeps_the_plain_weight_on_the_plain_kernel(dtype):
    """``pack_for_cpu(packed_layout=False)`` (the benchmarks' ``*-plain`` formats): the
    project's plain kernel over the checkpoint's [N, K] weight, on any CPU."""
    assert cpu_build.load_cpu_ops() is not None, "the CPU kernels did not build"
    torch.manual_seed(5)
    col = ColumnParallelLinear(96, 128, params_dtype=dtype)
    col.weight.data.copy_(torch.randn(128, 96))
    w = col.weight.data.clone()
    assert col.pack_for_cpu(packed_layout=False)
    assert col._own_packed is None and col._packed is None and col._skinny is not None
    assert torch.equal(col.weight.data, w)
    weight, scale, bias = col.kernel_operands()
    assert weight is col.weight and scale is None and bias is None
    for rows in (1, 5, 20):  # the dot-product tiles and the broadcast blocks
        x = torch.randn(rows, 96).to(dtype)
        want = x.double() @ w.double().t()
        assert _close(col(x), want, 96), rows
