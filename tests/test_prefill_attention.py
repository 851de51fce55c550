"""The CPU prefill attention kernel (``csrc/prefill_attention_cpu.cpp``) against torch's SDPA
with the same causal-with-context mask, and its place in the CPU kernel backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagectl.engine.attention import cpu_build


def _ops():
    ops = cpu_build.load_cpu_ops()
    assert ops is not None, "the CPU kernels did not build"
    return ops


def _reference(q, k, v, context_len, scale):
    """float32 SDPA over [L, H, D] queries and [S, KH, D] keys, row r seeing keys <= ctx + r."""
    rows, heads, _ = q.shape
    keys, kv_heads, _ = k.shape
    mask = torch.arange(keys)[None, :] <= (context_len + torch.arange(rows))[:, None]
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1).unsqueeze(0),
        k.float().transpose(0, 1).unsqueeze(0),
        v.float().transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=heads != kv_heads,
    )
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_matches_sdpa_with_context_and_gqa(dtype):
    """Rows within one query block and across several, a context that is not a multiple of
    the 16-key tile, MHA and GQA groups of 2 to 4, every supported head size shape (one to
    eight vectors, and 80/96 that are not powers of two), and q/out strided as the qkv
    projection's views are."""
    ops = _ops()
    g = torch.Generator().manual_seed(0)
    # float32: the float32 sums of SDPA in another order; bf16: the output's rounding.
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    for rows, ctx, heads, kv_heads, dim in [
        (1, 0, 2, 1, 16),
        (5, 0, 4, 2, 64),
        (17, 3, 8, 4, 64),
        (40, 0, 8, 8, 32),
        (33, 20, 4, 1, 128),
        (100, 50, 16, 8, 128),
        (16, 16, 2, 2, 80),
        (3, 40, 6, 2, 96),
        (70, 0, 4, 4, 48),
    ]:
        width = (heads + 2 * kv_heads) * dim
        qkv = torch.randn(rows, width, generator=g).to(dtype)
        q = qkv[:, : heads * dim].view(rows, heads, dim)  # rows `width` apart
        k = torch.randn(ctx + rows, kv_heads, dim, generator=g).to(dtype)
        v = torch.randn(ctx + rows, kv_heads, dim, generator=g).to(dtype)
        out_rows = torch.full((rows, 2 * heads * dim), float("nan"), dtype=dtype)
        out = out_rows[:, heads * dim :].view(rows, heads, dim)
        ops.prefill_attention(q, k, v, ctx, dim**-0.5, out)
        want = _reference(q, k, v, ctx, dim**-0.5)
        err = (out.float() - want).abs().max().item()
        assert err < tol, (rows, ctx, heads, kv_heads, dim, err)
        assert torch.isnan(out_rows[:, : heads * dim]).all()  # nothing written outside out


def test_prefill_attention_refuses_what_it_cannot_do():
    ops = _ops()
    q = torch.randn(4, 2, 64)
    kv = torch.randn(4, 1, 64)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="context_len"):
        ops.prefill_attention(q, kv, kv, 1, 0.125, out)
    with pytest.raises(RuntimeError, match="head_dim 24"):
        ops.prefill_attention(
            torch.randn(4, 2, 24),
            torch.randn(4, 1, 24),
            torch.randn(4, 1, 24),
            0,
            0.2,
            torch.empty(4, 2, 24),
        )
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        h = q.half()
        ops.prefill_attention(h, kv.half(), kv.half(), 0, 0.125, torch.empty_like(h))
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        ops.prefill_attention(
            torch.randn(4, 3, 64),
            kv.expand(4, 2, 64).contiguous(),
            kv.expand(4, 2, 64).contiguous(),
            0,
            0.125,
            torch.empty(4, 3, 64),
        )


def test_backend_sends_prefills_to_the_kernel_and_float16_to_sdpa(monkeypatch):
    """Where the build's rule (``prefill_attention_fast``) takes them: every prefill on
    AVX-512 (2), prompts without cached context on AVX2 (1, the other to SDPA). With the
    rule widened, the kernel's cached-context path through the backend (keys gathered from
    the blocks) matches the reference on any build."""
    from pagectl.engine.attention.cpu_kernel import CpuKernelPagedAttention
    from pagectl.engine.attention.torch_paged import PrefillSeq, TorchPagedAttention

    ops = _ops()
    fast = int(ops.prefill_attention_fast())
    if fast == 0:
        pytest.skip("the kernel is built without AVX2 or AVX-512: prefills stay on SDPA")
    calls = []
    monkeypatch.setattr(
        TorchPagedAttention, "attend_prefills", staticmethod(lambda *a: calls.append(a))
    )
    g = torch.Generator().manual_seed(1)
    # Two sequences in one step: one fresh (6 rows), one with 5 cached tokens in two blocks
    # of 4 (3 new rows).
    q = torch.randn(9, 4, 32, generator=g)
    k = torch.randn(9, 2, 32, generator=g)
    v = torch.randn(9, 2, 32, generator=g)
    cache = torch.randn(2, 3, 4, 2, 32, generator=g)
    cache[0, 0, 1:4] = k[6:9]  # the step's K/V already written: positions 5-7, block 0
    cache[1, 0, 1:4] = v[6:9]
    prefills = [
        PrefillSeq(0, 6, 6, 0, None, None),
        PrefillSeq(6, 9, 8, 5, torch.tensor([2, 0]), None),
    ]
    keys = cache[0, [2, 0]].reshape(-1, 2, 32)
    values = cache[1, [2, 0]].reshape(-1, 2, 32)
    for rule in sorted({fast, 2}):  # the build's rule, and every prefill on the kernel
        backend = CpuKernelPagedAttention(torch.device("cpu"), ops, prefill_rule=rule)
        with_context = rule > 1
        calls.clear()
        out = torch.full_like(q, float("nan"))
        backend.attend_prefills(q, k, v, cache, prefills, 0.2, out)
        torch.testing.assert_close(out[:6], _reference(q[:6], k[:6], v[:6], 0, 0.2))
        if with_context:
            assert calls == []
            torch.testing.assert_close(out[6:], _reference(q[6:], keys, values, 5, 0.2))
        else:
            assert len(calls) == 1 and [id(p) for p in calls[0][4]] == [id(prefills[1])]
            assert out[6:].isnan().all()
    calls.clear()
    backend.attend_prefills(q.half(), k.half(), v.half(), cache.half(), prefills, 0.2, out.half())
    assert len(calls) == 1
