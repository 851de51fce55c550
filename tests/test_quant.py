"""Weight-only quantization: torch's int8/int4 CPU kernels against their dequantized weights,
load-time int8/int4 against float32 transformers, AWQ / GPTQ / FP8 checkpoints written in the
test against the float checkpoint of the weights they stand for, refusals by name.

Tolerances (the largest |logprob difference| of a prompt's tokens, against float32):
- checkpoint int4 vs its dequantized float weights: 0.05 (activations and scales rounded to
  bfloat16 in the kernel; measured 0.011);
- FP8 vs its dequantized weights: 1e-4 (dequantized to float32 at load, the float path;
  measured 0);
- load-time int8 vs the float model: 0.1 (measured 0.03-0.05 on the tiny Qwen2/Qwen3);
  load-time int4: 0.6 (int4 rounding of the weights; measured 0.27-0.41).
"""

from __future__ import annotations

import json

import pytest
import torch
from quant_checkpoints import write_fp8, write_int4
from tiny_models import build_tiny_model, hf_greedy, random_prompts

from pagectl.engine.args import EngineArgs
from pagectl.engine.builder import build_engine
from pagectl.engine.loader import load_model
from pagectl.engine.model_config import ModelConfig
from pagectl.engine.models.linear import ColumnParallelLinear, RowParallelLinear
from pagectl.engine.models.parallel import TPGroup
from pagectl.engine.quant.kernels import Int4Weight, Int8Weight
from pagectl.engine.sampling_params import SamplingParams

VOCAB = 384
PROMPTS = random_prompts(3, VOCAB, [5, 12, 23], 0, [])


@pytest.fixture(scope="module")
def float_models(tmp_path_factory):
    cache: dict[str, object] = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = build_tiny_model(tmp_path_factory.mktemp(arch), arch, vocab_size=VOCAB)
        return cache[arch]

    return get


def _prompt_logprobs(path, **kw) -> torch.Tensor:
    """Logprob of each prompt token after the first, for every prompt, as the engine scores
    them (one engine, all prompts)."""
    built = build_engine(EngineArgs(model=str(path), dtype="float32", num_kv_blocks=64, **kw))
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
        got: dict[str, list[float]] = {str(i): [] for i in range(len(PROMPTS))}
        for i, p in enumerate(PROMPTS):
            built.core.add_request(str(i), p, sp)
        while built.core.has_unfinished():
            for o in built.core.step():
                got[o.request_id].extend(lp.logprob for lp in o.prompt_logprobs or [])
        return torch.tensor([x for i in range(len(PROMPTS)) for x in got[str(i)]])
    finally:
        built.shutdown()


def _max_logprob_diff(a_path, b_path, a_kw=None, b_kw=None) -> float:
    a = _prompt_logprobs(a_path, **(a_kw or {}))
    b = _prompt_logprobs(b_path, **(b_kw or {}))
    assert a.numel() == sum(len(p) - 1 for p in PROMPTS)
    return (a - b).abs().max().item()


# -- kernels ------------------------------------------------------------------------------


def test_int8_kernel_matches_its_dequantized_weight():
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    x = torch.randn(5, 64)
    q = Int8Weight.quantize(w)
    assert (q.dequantize() - w).abs().max() <= w.abs().amax() / 127  # half a step, with slack
    # The project kernel: float32 activations as they are, float32 accumulation.
    assert q._ops is not None, "the CPU kernels did not build"
    assert torch.allclose(q.matmul(x), x @ q.dequantize().t(), rtol=1e-5, atol=1e-4)
    assert q.matmul(x).dtype == torch.float32
    assert q.matmul(x.bfloat16()).dtype == torch.bfloat16
    # torch's kernel (the fallback): the input rounded to bfloat16 first.
    q._ops = None
    ref = x.bfloat16().float() @ q.dequantize().t()
    assert torch.allclose(q.matmul(x), ref, rtol=2e-2, atol=2e-2)
    assert q.matmul(x).dtype == torch.float32


def test_skinny_linear_matches_float32_matmul_for_every_weight_dtype():
    from pagectl.engine.attention import cpu_build

    ops = cpu_build.load_cpu_ops()
    assert ops is not None, "the CPU kernels did not build"
    torch.manual_seed(0)
    # Few rows: row counts across the tile sizes (3 rows per pass, 4 weight rows per tile),
    # output features with a partial tile, an input width that is not a power of two. From
    # 16 rows (the blocked shape): whole and partial blocks of 16 and 8 rows, a partial tile
    # of 6 weight rows, and inputs wide enough (at 100 and 127 rows) that x is taken in
    # several chunks of features.
    for m, n, k in [
        (1, 48, 64),
        (1, 53, 136),
        (2, 30, 40),
        (3, 16, 8),
        (7, 53, 136),
        (15, 53, 136),
        (16, 64, 512),
        (17, 7, 64),
        (24, 100, 520),
        (33, 97, 136),
        (100, 61, 1536),
        (127, 13, 3072),
    ]:
        x = torch.randn(m, k)
        w = torch.randn(n, k)
        # Sums of k products of unit normals: rounding grows with k (summation order).
        atol = 2e-6 * max(k, 64)
        bias = torch.randn(n)
        want = x @ w.t() + bias
        assert torch.allclose(ops.skinny_linear(x, w, None, bias), want, rtol=1e-5, atol=atol)
        wb = w.bfloat16()
        want_b = x @ wb.float().t()
        assert torch.allclose(ops.skinny_linear(x, wb, None, None), want_b, rtol=1e-5, atol=atol)
        out_b = ops.skinny_linear(x.bfloat16(), wb, None, None)
        assert out_b.dtype == torch.bfloat16
        assert torch.allclose(
            out_b.float(), x.bfloat16().float() @ wb.float().t(), rtol=1e-2, atol=5e-2
        )
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scale = torch.rand(n) / 100
        want_q = x @ (q.float() * scale[:, None]).t()
        got_q = ops.skinny_linear(x, q, scale, None)
        assert torch.allclose(got_q, want_q, rtol=1e-5, atol=atol)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="needs its scale"):
        ops.skinny_linear(x, torch.zeros(4, 64, dtype=torch.int8), None, None)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.skinny_linear(torch.randn(2, 12), torch.randn(4, 12), None, None)
    with pytest.raises(RuntimeError, match="features"):
        ops.skinny_linear(x, torch.randn(4, 32), None, None)


def test_skinny_linear_bf16_by_bf16_rounds_the_float32_sum_once():
    """bfloat16 x times a plain bfloat16 weight: each output is the float32 sum of the
    exact products, scaled, biased and rounded to bfloat16 once: within one bfloat16 step
    (2^-8 relative) of the float64 reference, plus float32 summation error. Shapes cover
    both of the kernel's regimes (dot products below 16 rows, blocks of 16 rows from there,
    a block of 8 at the end), partial weight tiles and chunked features."""
    from pagectl.engine.attention import cpu_build

    ops = cpu_build.load_cpu_ops()
    assert ops is not None, "the CPU kernels did not build"
    torch.manual_seed(1)
    for m, n, k in [
        (1, 53, 136),
        (1, 200, 1024),
        (2, 30, 40),
        (3, 16, 8),
        (7, 53, 136),
        (15, 25, 520),
        (16, 64, 512),
        (31, 13, 72),
        (32, 97, 136),
        (33, 7, 64),
        (48, 100, 520),
        (100, 61, 1536),
        (127, 29, 3072),
    ]:
        x = torch.randn(m, k).bfloat16()
        w = torch.randn(n, k).bfloat16()
        scale = torch.rand(n) + 0.5
        bias = torch.randn(n)
        ref = (x.double() @ w.double().t()) * scale.double() + bias.double()
        for s_, b_ in ((None, None), (scale, bias)):
            got = ops.skinny_linear(x, w, s_, b_)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            want = ref if s_ is not None else x.double() @ w.double().t()
            tol = want.abs() * 2.0**-8 + 1e-5 * k
            err = (got.double() - want).abs()
            assert bool((err <= tol).all()), (m, n, k, float((err - tol).max()))
    # A strided x is copied, not misread.
    x = torch.randn(40, 2 * 136).bfloat16()[:, ::2]
    w = torch.randn(20, 136).bfloat16()
    want = x.double() @ w.double().t()
    err = (ops.skinny_linear(x, w, None, None).double() - want).abs()
    assert bool((err <= want.abs() * 2.0**-8 + 1e-3).all())


def test_int4_kernel_matches_its_dequantized_weight():
    torch.manual_seed(0)
    w = torch.randn(32, 128)
    x = torch.randn(5, 128)
    q = Int4Weight.quantize(w, 64)
    deq = q.dequantize()
    step = (w.reshape(32, 2, 64).amax(-1) - w.reshape(32, 2, 64).amin(-1)) / 15
    err = (deq - w).abs().reshape(32, 2, 64).amax(-1)
    assert (err <= step * 0.55 + 0.02).all()  # half a step (+ bfloat16 rounding of scales)
    ref = x.bfloat16().float() @ deq.t()
    assert torch.allclose(q.matmul(x), ref, rtol=2e-2, atol=5e-2)


def test_int4_refuses_shapes_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="divisible by 16"):
        Int4Weight.quantize(torch.randn(40, 64), 32)
    with pytest.raises(ValueError, match="does not fit"):
        Int4Weight.quantize(torch.randn(32, 48), 32)


def test_quantization_is_per_rank_shard():
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    whole = Int8Weight.quantize(w).dequantize()
    col = ColumnParallelLinear(128, 64, tp=TPGroup(1, 2))
    col.weight_loader(col.weight, w)
    col.quantize("int8", 128)
    assert torch.equal(col.quantized.dequantize(), whole[32:])  # per-channel: same rows
    row = RowParallelLinear(128, 64, tp=TPGroup(1, 2), reduce_results=False)
    row.weight_loader(row.weight, w)
    row.quantize("int4", 64)
    q = row.quantized
    assert (q.in_features, q.out_features, q.group_size) == (64, 64, 64)
    assert torch.equal(q.dequantize(), Int4Weight.quantize(w[:, 64:], 64).dequantize())


# -- load-time int8 / int4 ----------------------------------------------------------------


def test_int8_greedy_matches_transformers_float32(float_models):
    path = float_models("qwen3")
    ref = hf_greedy(path, PROMPTS, 8)
    built = build_engine(
        EngineArgs(model=str(path), dtype="float32", num_kv_blocks=64, quantization="int8")
    )
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for i, p in enumerate(PROMPTS):
            built.core.add_request(str(i), p, sp)
        out: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
        while built.core.has_unfinished():
            for o in built.core.step():
                out[o.request_id].extend(o.new_token_ids)
    finally:
        built.shutdown()
    for i, r in enumerate(ref):
        assert out[str(i)] == r, f"prompt {i}"


@pytest.mark.parametrize(("method", "tolerance"), [("int8", 0.1), ("int4", 0.6)])
def test_load_time_quantization_logprobs_close_to_float(float_models, method, tolerance):
    path = float_models("qwen2")
    diff = _max_logprob_diff(path, path, {"quantization": method})
    assert diff < tolerance
    assert diff > 0  # the quantized path really ran


def test_load_time_quantization_replaces_every_matmul_weight(float_models):
    path = float_models("llama")
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"), quantization="int4")
    for layer in model._projections():
        assert isinstance(layer.quantized, Int4Weight) and layer.weight.numel() == 0
    assert isinstance(model.lm_head.quantized, Int8Weight)
    assert model.model.embed_tokens.weight.numel() > 0  # lookups stay float


# -- quantized checkpoints ----------------------------------------------------------------


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_checkpoint_matches_dequantized_reference(float_models, tmp_path, method):
    qdir, rdir = write_int4(float_models("qwen2"), tmp_path, method)
    cfg = ModelConfig.from_dir(qdir)
    model = load_model(qdir, cfg, torch.float32, torch.device("cpu"))
    assert model.quant_config.describe() == f"int4 ({method} checkpoint)"
    ref = load_model(rdir, ModelConfig.from_dir(rdir), torch.float32, torch.device("cpu"))
    for ours, theirs in zip(model._projections(), ref._projections(), strict=True):
        assert isinstance(ours.quantized, Int4Weight)
        assert ours.quantized.group_size == 32
        want = theirs.weight.data
        # Only the bfloat16 rounding of scales and zeros separates the two.
        assert torch.allclose(ours.quantized.dequantize(), want, atol=4e-3 * want.abs().max())
    assert _max_logprob_diff(qdir, rdir) < 0.05


def test_gptq_act_order_is_refused(float_models, tmp_path):
    from safetensors.torch import load_file, save_file

    qdir, _ = write_int4(float_models("llama"), tmp_path, "gptq")
    tensors = load_file(str(qdir / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(qdir / "model.safetensors"))
    with pytest.raises(ValueError, match="act-order"):
        load_model(qdir, ModelConfig.from_dir(qdir), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("scheme", ["tensor", "block"])
def test_fp8_checkpoint_applies_its_scales(float_models, tmp_path, scheme):
    qdir, rdir = write_fp8(float_models("llama"), tmp_path, scheme)
    cfg = ModelConfig.from_dir(qdir)
    model = load_model(qdir, cfg, torch.float32, torch.device("cpu"))
    ref = load_model(rdir, ModelConfig.from_dir(rdir), torch.float32, torch.device("cpu"))
    for ours, theirs in zip(model._projections(), ref._projections(), strict=True):
        assert torch.equal(ours.weight, theirs.weight)
    assert _max_logprob_diff(qdir, rdir) < 1e-4


def test_float8_tensors_without_a_quantization_config_are_refused(float_models, tmp_path):
    qdir, _ = write_fp8(float_models("llama"), tmp_path, "tensor")
    cfg = json.loads((qdir / "config.json").read_text())
    del cfg["quantization_config"]
    (qdir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="float8"):
        load_model(qdir, ModelConfig.from_dir(qdir), torch.float32, torch.device("cpu"))


def _with_quant_config(float_models, tmp_path, qc):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(float_models("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("method", ["bitsandbytes", "compressed-tensors", "exl2"])
def test_unknown_quant_method_is_refused_by_name(float_models, tmp_path, method):
    d = _with_quant_config(float_models, tmp_path, {"quant_method": method})
    with pytest.raises(ValueError, match=f"{method!r} is not supported"):
        build_engine(EngineArgs(model=str(d), num_kv_blocks=16))


@pytest.mark.parametrize(
    ("qc", "message"),
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8 bits"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
        ({"quant_method": "awq", "bits": 4, "group_size": 48}, "group_size 48"),
    ],
)
def test_unsupported_int4_formats_are_refused(float_models, tmp_path, qc, message):
    d = _with_quant_config(float_models, tmp_path, qc)
    with pytest.raises(ValueError, match=message):
        build_engine(EngineArgs(model=str(d), num_kv_blocks=16))


def test_int4_checkpoint_cannot_be_requantized_to_int8(float_models, tmp_path):
    qdir, _ = write_int4(float_models("llama"), tmp_path, "awq")
    with pytest.raises(ValueError, match="awq int4"):
        build_engine(EngineArgs(model=str(qdir), num_kv_blocks=16, quantization="int8"))


def test_quantization_is_refused_off_cpu(float_models):
    from pagectl.engine.quant.config import resolve_quantization

    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("int8", {}, "cuda")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="int3")


def test_float32_layers_use_the_kernel_on_their_plain_weight():
    from pagectl.engine.models import linear
    from pagectl.engine.models.linear import ColumnParallelLinear

    torch.manual_seed(0)
    layer = ColumnParallelLinear(64, 200, bias=True)
    w, b = torch.randn(200, 64), torch.randn(200)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    assert layer.pack_for_cpu()
    assert layer._skinny is not None and layer._packed is None  # no packed copy
    assert layer.weight.data_ptr() != 0 and layer.weight.shape == (200, 64)
    # Every regime: few rows, blocks, and from DENSE_MIN_ROWS on torch's GEMM.
    for m in (1, 3, 16, 40, linear.DENSE_MIN_ROWS + 5):
        x = torch.randn(m, 64)
        torch.testing.assert_close(layer(x), x @ w.t() + b, rtol=1e-5, atol=1e-4)
    x = torch.randn(2, 5, 64)  # 3-D input keeps its leading dims
    torch.testing.assert_close(layer(x), x @ w.t() + b, rtol=1e-5, atol=1e-4)


def test_skinny_linear_takes_a_strided_input():
    from pagectl.engine.attention import cpu_build

    ops = cpu_build.load_cpu_ops()
    assert ops is not None
    x = torch.randn(6, 80)[:, 8:72]  # rows 80 apart
    w = torch.randn(24, 64)
    torch.testing.assert_close(ops.skinny_linear(x, w, None, None), x @ w.t())


def test_many_row_matmuls_widen_to_float32_and_agree_with_the_few_row_kernel(monkeypatch):
    from pagectl.engine.models import linear
    from pagectl.engine.models.linear import ColumnParallelLinear

    torch.manual_seed(0)
    monkeypatch.setattr(linear, "DENSE_SLICE_ELEMS", 64 * 40)  # several slices for N = 200
    for kind in ("int8", "bfloat16"):
        layer = ColumnParallelLinear(64, 200, bias=True)
        layer.weight.data.copy_(torch.randn(200, 64))
        layer.bias.data.copy_(torch.randn(200))
        if kind == "int8":
            layer.quantize("int8", 128)
            dtype = torch.float32
        else:
            layer.weight.data = layer.weight.data.bfloat16()
            layer.bias.data = layer.bias.data.bfloat16()
            dtype = torch.bfloat16
        layer.pack_for_cpu()
        x = torch.randn(linear.DENSE_MIN_ROWS + 3, 64).to(dtype)
        dense = layer(x)  # the widened GEMM
        few = torch.cat([layer(x[i : i + 4]) for i in range(0, x.shape[0], 4)])  # the kernel
        assert dense.dtype == few.dtype == dtype
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(dense.float(), few.float(), rtol=tol, atol=tol)
