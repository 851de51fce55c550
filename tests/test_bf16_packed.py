"""The packed bfloat16 matmul (``csrc/packed_bf16_linear_cpu.cpp``) on CPUs with AVX512-BF16:
the layout ``pack_bf16_weight`` writes, the op's result against a float64 reference, the
layers that take it (and those that keep the plain weight), and a tied LM head whose
embedding gathers its rows from the packed copy. Skipped where the library has no such
kernel (no AVX512-BF16): there the plain kernels run, tested in test_quant.py."""

from __future__ import annotations

import pytest
import torch

from pagectl.engine.attention import cpu_build
from pagectl.engine.models.embedding import ParallelLMHead, VocabParallelEmbedding
from pagectl.engine.models.linear import ColumnParallelLinear, RowParallelLinear


def _ops():
    ops = cpu_build.load_cpu_ops()
    assert ops is not None, "the CPU kernels did not build"
    if not ops.packed_bf16_available():
        pytest.skip("this CPU has no AVX512-BF16: no packed bfloat16 kernel")
    return ops


def test_pack_lays_out_pairs_of_64_features():
    ops = _ops()
    n, k = 128, 24
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k).bfloat16()
    p = ops.pack_bf16_weight(w)
    assert p.shape == (n // 64, k // 2, 64, 2) and p.dtype == torch.bfloat16
    for t, pair, col, half in [(0, 0, 0, 0), (1, 5, 17, 1), (0, 11, 63, 0), (1, 0, 0, 1)]:
        assert torch.equal(p[t, pair, col, half], w[64 * t + col, 2 * pair + half])
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ops.pack_bf16_weight(torch.zeros(96, 16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.pack_bf16_weight(torch.zeros(64, 16))


def test_packed_matmul_rounds_the_float32_sum_once():
    """Within one bfloat16 step of the float64 result, plus float32 summation error, for
    every row count shape of the kernel: one row, a partial pass of 2-5 rows, whole passes
    of 6, and more rows than one block of x keeps in L2 (K = 3072: 30 rows a block)."""
    ops = _ops()
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
        x = torch.randn(m, k).bfloat16()
        w = torch.randn(n, k).bfloat16()
        scale, bias = torch.rand(n) + 0.5, torch.randn(n)
        packed = ops.pack_bf16_weight(w)
        exact = x.double() @ w.double().t()
        for s, b, want in ((None, None, exact), (scale, bias, exact * scale.double() + bias)):
            got = ops.skinny_linear(x, packed, s, b)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            err = (got.double() - want).abs()
            assert bool((err <= want.abs() * 2.0**-8 + 1e-5 * k).all()), (m, n, k)
    packed = ops.pack_bf16_weight(torch.randn(64, 32).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16 x only"):
        ops.skinny_linear(torch.randn(2, 32), packed, None, None)
    with pytest.raises(RuntimeError, match="input features"):
        ops.skinny_linear(torch.randn(2, 16).bfloat16(), packed, None, None)


def test_layers_take_the_packed_weight_where_it_fits():
    _ops()
    torch.manual_seed(1)
    col = ColumnParallelLinear(96, 128, bias=True, params_dtype=torch.bfloat16)
    col.weight.data.copy_(torch.randn(128, 96))
    col.bias.data.copy_(torch.randn(128))
    w, b = col.weight.data.clone(), col.bias.data.clone()
    assert col.pack_for_cpu()
    assert col._bf16_packed is not None and col.weight.numel() == 0  # one copy only
    weight, scale, bias = col.kernel_operands()
    assert weight is col._bf16_packed and scale is None and bias is col.bias
    for rows in (1, 7, 300):  # 300: past DENSE_MIN_ROWS, still the packed kernel
        x = torch.randn(rows, 96).bfloat16()
        want = x.double() @ w.double().t() + b.double()
        err = (col(x).double() - want).abs()
        assert bool((err <= want.abs() * 2.0**-8 + 1e-3).all()), rows
    # 3-D activations keep their shape.
    assert col(torch.randn(2, 3, 96).bfloat16()).shape == (2, 3, 128)
    # 80 output features: not whole tiles of 64, so another path (oneDNN's packed layout
    # where it takes bfloat16, else the plain kernel), with the same result.
    odd = RowParallelLinear(64, 80, params_dtype=torch.bfloat16)
    odd.weight.data.copy_(torch.randn(80, 64))
    w = odd.weight.data.clone()
    assert odd.pack_for_cpu() and odd._bf16_packed is None
    x = torch.randn(4, 64).bfloat16()
    want = x.double() @ w.double().t()
    assert bool(((odd(x).double() - want).abs() <= want.abs() * 2.0**-7 + 1e-3).all())
    # Float32 weights are not packed this way.
    f32 = ColumnParallelLinear(64, 64, params_dtype=torch.float32)
    f32.weight.data.copy_(torch.randn(64, 64))
    assert f32.pack_for_cpu() and f32._bf16_packed is None


def test_a_tied_head_packs_once_and_its_embedding_reads_the_packed_rows():
    _ops()
    torch.manual_seed(2)
    vocab, dim = 192, 48
    emb = VocabParallelEmbedding(vocab, dim, params_dtype=torch.bfloat16)
    emb.weight.data.copy_(torch.randn(vocab, dim))
    head = ParallelLMHead(vocab, dim, params_dtype=torch.bfloat16)
    head.tie(emb)
    rows = emb.weight.data.clone()
    assert head.pack_for_cpu()
    assert emb.weight.numel() == 0 and emb._packed_rows is head._bf16_packed
    ids = torch.tensor([[0, 63, 64, 191], [5, 130, 5, 2]])
    assert torch.equal(emb(ids), rows[ids])
    hidden = torch.randn(3, dim).bfloat16()
    want = hidden.double() @ rows.double().t()
    got = head.compute_logits(hidden)
    assert got.dtype == torch.float32
    assert bool(((got.double() - want).abs() <= want.abs() * 2.0**-8 + 1e-3).all())
