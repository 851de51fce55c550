"""The compiled CPU decode kernel: against dense attention, across shapes, dtypes and thread
counts; its build cache (one compile under concurrency, remembered failures, timeouts); the
backend selection's fallback; and, through the engine, greedy equality with transformers."""

from __future__ import annotations

import os
import stat
import sys
import threading

import numpy as np
import pytest
import torch
from test_attention import dense_reference, make_batch
from tiny_models import build_tiny_model, engine_greedy, hf_greedy

from pagectl.engine.args import EngineArgs
from pagectl.engine.attention import TorchPagedAttention, cpu_build, select_backend
from pagectl.engine.attention.cpu_kernel import CpuKernelPagedAttention
from pagectl.engine.builder import build_engine

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ops():
    if cpu_build.find_compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    loaded = cpu_build.load_cpu_ops()
    assert loaded is not None, f"the kernel did not build: {cpu_build.failure_reason()}"
    return loaded


def lengths_around_blocks(block_size: int) -> list[int]:
    """Decode context lengths (before the new token) on and around block boundaries."""
    bs = block_size
    return sorted({0, 1, bs - 1, bs, bs + 1, 2 * bs - 1, 3 * bs, 3 * bs + 1, 37, 70})


@pytest.mark.parametrize(
    "block_size,heads,kv_heads,head_dim",
    [
        (16, 8, 4, 64),  # the benchmark model's shape (vector path)
        (4, 4, 1, 32),  # GQA 4:1
        (8, 16, 2, 128),  # GQA 8:1, the largest vector size
        (32, 6, 6, 24),  # no GQA, a head size off the vector path
        (1, 4, 2, 16),  # one token per block
        (16, 4, 2, 80),
    ],
)
def test_mixed_batch_matches_dense(ops, block_size, heads, kv_heads, head_dim):
    decodes = [(c, 1) for c in lengths_around_blocks(block_size)]
    prefills = [(0, 9), (21, 7), (1, 2), (48, 16)]
    seqs = decodes + prefills
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 8
    cache, full_k, full_v, q, k, v, meta = make_batch(
        seqs, block_size, num_blocks, heads, kv_heads, head_dim
    )
    backend = CpuKernelPagedAttention(CPU, ops)
    backend.prepare(meta)
    scale = head_dim**-0.5
    out = backend.forward(q, k, v, cache, meta, scale)
    cu = meta.query_start_loc_host
    for i, (ctx, _) in enumerate(seqs):
        ref = dense_reference(q[cu[i] : cu[i + 1]], full_k[i], full_v[i], ctx, scale)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], ref, atol=1e-5, rtol=1e-5)


def test_matches_torch_backend_on_strided_queries(ops):
    # q as the model passes it: the first heads of a wider [T, q + k heads, D] tensor.
    seqs = [(c, 1) for c in (3, 15, 16, 17, 63, 64, 65, 200)]
    cache, _, _, q, k, v, meta = make_batch(seqs, 16, 64, 8, 4, 64, seed=3)
    wide = torch.cat([q, torch.randn(q.shape[0], 4, 64)], dim=1)
    q_view = wide[:, :8]
    assert not q_view.is_contiguous()
    kernel = CpuKernelPagedAttention(CPU, ops)
    kernel.prepare(meta)
    got = kernel.forward(q_view, k, v, cache.clone(), meta, 0.125)
    torch_backend = TorchPagedAttention(CPU)
    torch_backend.prepare(meta)
    want = torch_backend.forward(q, k, v, cache.clone(), meta, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_seqs", [1, 3, 40])
def test_thread_counts_give_identical_results(ops, num_seqs):
    # Work is split by sequence, or by KV-head ranges when sequences are few; every query
    # head is computed the same way whichever thread does it, so results are bitwise equal.
    rng = np.random.default_rng(num_seqs)
    seqs = [(int(c), 1) for c in sorted(rng.integers(1, 300, num_seqs))]
    num_blocks = sum(-(-(c + 1) // 16) for c, _ in seqs) + 4
    cache, _, _, q, k, v, meta = make_batch(seqs, 16, num_blocks, 8, 4, 64)
    cache[0].view(-1, 4, 64).index_copy_(0, meta.slot_mapping, k)
    cache[1].view(-1, 4, 64).index_copy_(0, meta.slot_mapping, v)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = torch.full_like(q, float("nan"))
            ops.paged_decode(q, cache, meta.block_tables, meta.seq_lens, 0.125, out)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert not outs[0].isnan().any()
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize(
    "block_size,heads,kv_heads,head_dim",
    [(16, 8, 4, 64), (1, 4, 2, 64), (4, 6, 2, 128), (32, 3, 1, 64), (64, 8, 4, 32), (8, 4, 4, 16)],
)
def test_bfloat16_matches_float32_math_across_blocks_and_groups(
    ops, block_size, heads, kv_heads, head_dim
):
    # bfloat16 caches take bfloat16 dot products for the scores on a CPU with AVX512-BF16
    # (query heads in pairs, an odd group's last one alone): odd and even context lengths,
    # blocks of 1 to 64 keys, groups of 1 to 3 query heads, head sizes 16 to 128.
    seqs = [(c, 1) for c in lengths_around_blocks(block_size)]
    num_blocks = sum(-(-(c + 1) // block_size) for c, _ in seqs) + 4
    cache, _, _, q, k, v, meta = make_batch(
        seqs, block_size, num_blocks, heads, kv_heads, head_dim, seed=block_size
    )
    flat = (-1, kv_heads, head_dim)
    cache[0].view(*flat).index_copy_(0, meta.slot_mapping, k)
    cache[1].view(*flat).index_copy_(0, meta.slot_mapping, v)
    cache_h, q_h = cache.to(torch.bfloat16), q.to(torch.bfloat16)
    scale = head_dim**-0.5
    out = torch.full_like(q_h, float("nan"))
    ops.paged_decode(q_h, cache_h, meta.block_tables, meta.seq_lens, scale, out)
    want = torch.empty_like(q)
    ops.paged_decode(q_h.float(), cache_h.float(), meta.block_tables, meta.seq_lens, scale, want)
    # Same float32 math on the same rounded inputs; the output is rounded to bfloat16.
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_match_float32_math(ops, dtype):
    seqs = [(c, 1) for c in (5, 16, 33, 90)]
    cache, _, _, q, k, v, meta = make_batch(seqs, 16, 32, 8, 4, 64, seed=5)
    cache[0].view(-1, 4, 64).index_copy_(0, meta.slot_mapping, k)
    cache[1].view(-1, 4, 64).index_copy_(0, meta.slot_mapping, v)
    cache_h, q_h = cache.to(dtype), q.to(dtype)
    out = torch.empty_like(q_h)
    ops.paged_decode(q_h, cache_h, meta.block_tables, meta.seq_lens, 0.125, out)
    want = torch.empty_like(q)
    ops.paged_decode(q_h.float(), cache_h.float(), meta.block_tables, meta.seq_lens, 0.125, want)
    # Same float32 math on the same rounded inputs; only the output rounding differs.
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)


def test_bad_inputs_are_rejected(ops):
    seqs = [(4, 1), (9, 1)]
    cache, _, _, q, _, _, meta = make_batch(seqs, 4, 8, 2, 2, 16)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="int32"):
        ops.paged_decode(q, cache, meta.block_tables.long(), meta.seq_lens, 1.0, out)
    bad = meta.block_tables.clone()
    bad[1, 0] = 10_000
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_decode(q, cache, bad, meta.seq_lens, 1.0, out)
    too_long = meta.seq_lens.clone()
    too_long[0] = 1_000
    with pytest.raises(RuntimeError, match="out of range of its block table"):
        ops.paged_decode(q, cache, meta.block_tables, too_long, 1.0, out)


# -- the build cache, with a stand-in compiler ---------------------------------------------

FAKE_COMPILER = """\
#!{python}
import os, sys, time
if sys.argv[1:] == ["--version"]:
    print("fake-c++ 1.0")
    sys.exit(0)
with open(os.environ["FAKE_CXX_LOG"], "a") as f:
    f.write("compile\\n")
time.sleep(float(os.environ.get("FAKE_CXX_SLEEP", "0")))
if os.environ.get("FAKE_CXX_FAIL"):
    print("kernel.cpp:1: error: boom", file=sys.stderr)
    sys.exit(1)
out = sys.argv[sys.argv.index("-o") + 1]
with open(out, "w") as f:
    f.write("not really a library")
"""


@pytest.fixture
def fake_cxx(tmp_path, monkeypatch):
    """A stand-in compiler that logs each compile; returns a function reading the count."""
    script = tmp_path / "fake-cxx"
    script.write_text(FAKE_COMPILER.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "compiles.log"
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.setenv("FAKE_CXX_LOG", str(log))
    monkeypatch.setenv("PAGECTL_KERNEL_CACHE", str(tmp_path / "cache"))
    return lambda: len(log.read_text().splitlines()) if log.exists() else 0


def test_concurrent_builds_compile_once(fake_cxx, monkeypatch):
    monkeypatch.setenv("FAKE_CXX_SLEEP", "0.5")
    paths: list = []
    errors: list = []

    def build() -> None:
        try:
            paths.append(cpu_build.build_library())
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert fake_cxx() == 1
    assert len(set(paths)) == 1 and paths[0].is_file()
    # Built once: later calls only find it.
    assert cpu_build.build_library() == paths[0]
    assert fake_cxx() == 1
    # No temporary file is left beside the library.
    assert [p.name for p in paths[0].parent.iterdir()] == [paths[0].name]


def test_a_failed_build_is_remembered(fake_cxx, monkeypatch):
    monkeypatch.setenv("FAKE_CXX_FAIL", "1")
    with pytest.raises(cpu_build.KernelBuildError, match="boom"):
        cpu_build.build_library()
    with pytest.raises(cpu_build.KernelBuildError, match="earlier build failed"):
        cpu_build.build_library()
    assert fake_cxx() == 1


def test_a_slow_build_is_abandoned_and_retried_later(fake_cxx, monkeypatch):
    monkeypatch.setenv("FAKE_CXX_SLEEP", "5")
    with pytest.raises(cpu_build.KernelBuildError, match="longer than"):
        cpu_build.build_library(timeout_s=0.3)
    monkeypatch.setenv("FAKE_CXX_SLEEP", "0")
    assert cpu_build.build_library().is_file()  # not marked failed: tried again
    assert fake_cxx() == 2


def test_no_compiler(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(cpu_build.KernelBuildError, match="no C.. compiler"):
        cpu_build.build_library()


def test_cache_key_follows_the_source(monkeypatch, tmp_path, fake_cxx):
    compiler = os.environ["CXX"]
    assert cpu_build.build_key(compiler) == cpu_build.build_key(compiler)
    sources, headers = cpu_build.SOURCES, cpu_build.HEADERS
    # Copies at fixed paths: the key must follow each file's content, not only its path.
    copies = [tmp_path / f.name for f in (*sources, *headers)]
    for original, copy in zip((*sources, *headers), copies, strict=True):
        copy.write_text(original.read_text())
    monkeypatch.setattr(cpu_build, "SOURCES", tuple(copies[: len(sources)]))
    monkeypatch.setattr(cpu_build, "HEADERS", tuple(copies[len(sources) :]))
    for copy in copies:
        before = cpu_build.build_key(compiler)
        text = copy.read_text()
        copy.write_text(text + "\n// changed\n")
        assert cpu_build.build_key(compiler) != before, copy.name
        copy.write_text(text)
        assert cpu_build.build_key(compiler) == before


def test_auto_falls_back_to_torch_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(cpu_build, "load_cpu_ops", lambda: None)
    monkeypatch.setattr(cpu_build, "failure_reason", lambda: "compiling failed: boom")
    with caplog.at_level("WARNING"):
        first = select_backend("auto", CPU, 16, torch.float32)
        second = select_backend("auto", CPU, 16, torch.float32)
    assert first.name == second.name == "torch"
    assert len([r for r in caplog.records if "boom" in r.getMessage()]) == 1
    with pytest.raises(ValueError, match="cpu-kernel.*boom"):
        select_backend("cpu-kernel", CPU, 16, torch.float32)


def test_kernel_backend_needs_cpu_and_a_supported_dtype():
    with pytest.raises(ValueError, match="runs on cpu"):
        select_backend("cpu-kernel", torch.device("cuda"), 16, torch.float16)
    with pytest.raises(ValueError, match="float64"):
        select_backend("cpu-kernel", CPU, 16, torch.float64)
    assert select_backend("auto", CPU, 16, torch.float64).name == "torch"


# -- through the engine --------------------------------------------------------------------

VOCAB = 384


@pytest.mark.parametrize(
    "arch,overrides,block_size,budget",
    [
        ("qwen3", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64), 16, 37),
        ("llama", dict(num_attention_heads=8, num_key_value_heads=4, head_dim=24), 4, 2048),
    ],
)
def test_engine_greedy_matches_transformers(ops, tmp_path, arch, overrides, block_size, budget):
    g = torch.Generator().manual_seed(11)
    lengths = [1, 4, 15, 16, 17, 33, 50, 64]
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]
    path = build_tiny_model(tmp_path / arch, arch, vocab_size=VOCAB, config_overrides=overrides)
    reference = hf_greedy(path, prompts, 12)
    built = build_engine(
        EngineArgs(
            model=str(path),
            dtype="float32",
            block_size=block_size,
            num_kv_blocks=128,
            max_num_batched_tokens=budget,
            attention_backend="cpu-kernel",
        )
    )
    try:
        assert built.core.executor.backend.name == "cpu-kernel"
        out = engine_greedy(built.core, prompts, 12)
    finally:
        built.shutdown()
    for i, (ours, ref) in enumerate(zip(out["tokens"], reference, strict=True)):
        assert ours == ref, f"prompt {i} (length {lengths[i]})"
