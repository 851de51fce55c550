"""The Triton paged-attention backend, run on CPU by Triton's interpreter.

The kernels under test are the ones the GPU compiles: against a dense float64 reference and
the torch backend on random paged layouts (shuffled block tables, partial last blocks,
blocks shared by two sequences, chunks starting at odd offsets), at block sizes 16 to 256,
GQA ratios 1 to 8, head_dim 64/128 and the test models' odd ones, in float32 (1e-5) and the
half types; split-K decode; the K/V write; the CUDA-graph contract (a fake graph that
replays the recorded launches on new inputs); and a tiny model through the engine, token for
token against transformers. The interpreter is slow: shapes are kept small.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from paged_layout import paged_metadata
from test_attention import dense_reference
from tiny_models import engine_greedy, lazy_reference_models, random_prompts

from pagectl.engine.attention import TorchPagedAttention, select_backend
from pagectl.engine.attention.backend import DecodeGraphBuffers

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed (pip install triton; the 'test' extra has it)",
        allow_module_level=True,
    )

from pagectl.engine.attention.triton_paged import TritonPagedAttention  # noqa: E402

CPU = torch.device("cpu")


def paged_batch(
    seqs, block_size, heads, kv_heads, head_dim, *, shared_blocks=0, dtype=torch.float32, seed=0
):
    """A batch laid out in a paged cache with blocks drawn in random order.

    ``seqs``: (context_len, query_len) per sequence, decodes (query_len 1) first, sorted by
    length. With ``shared_blocks`` k, the last two sequences hold the same first k blocks
    (same ids, same K/V), as after a prefix-cache hit. Returns the cache (context written),
    every sequence's full K/V, the new rows' q/k/v and the metadata.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(blocks_needed) + 3
    free = torch.randperm(num_blocks, generator=g).tolist()
    cache = torch.zeros(2, num_blocks + 1, block_size, kv_heads, head_dim)
    tables, full_k, full_v, slots, qs, ks, vs = [], [], [], [], [], [], []
    for i, ((ctx, qlen), nb) in enumerate(zip(seqs, blocks_needed, strict=True)):
        total = ctx + qlen
        k = torch.randn(total, kv_heads, head_dim, generator=g)
        v = torch.randn(total, kv_heads, head_dim, generator=g)
        blocks = [free.pop() for _ in range(nb)]
        if shared_blocks and i == len(seqs) - 1:
            n = shared_blocks * block_size
            assert ctx >= n and seqs[-2][0] >= n, "shared blocks must be cached context"
            blocks[:shared_blocks] = tables[-1][:shared_blocks]
            k[:n], v[:n] = full_k[-1][:n], full_v[-1][:n]
        for p in range(total):
            b, off = blocks[p // block_size], p % block_size
            if p < ctx:
                cache[0, b, off], cache[1, b, off] = k[p], v[p]
            else:
                slots.append(b * block_size + off)
        tables.append(blocks)
        full_k.append(k)
        full_v.append(v)
        qs.append(torch.randn(qlen, heads, head_dim, generator=g))
        ks.append(k[ctx:])
        vs.append(v[ctx:])
    meta = paged_metadata(seqs, tables, slots, num_blocks, block_size)
    cat = [torch.cat(x).to(dtype) for x in (qs, ks, vs)]
    return cache.to(dtype), full_k, full_v, *cat, meta


def run_backend(backend, batch, scale):
    cache, _, _, q, k, v, meta = batch
    backend.prepare(meta)
    return backend.forward(q, k, v, cache, meta, scale)


def check_dense(out, batch, seqs, scale, atol, rtol):
    _, full_k, full_v, q, _, _, meta = batch
    cu = meta.query_start_loc_host
    for i, (ctx, _) in enumerate(seqs):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        ref = dense_reference(q[rows].float(), full_k[i], full_v[i], ctx, scale)
        torch.testing.assert_close(out[rows].float(), ref, atol=atol, rtol=rtol)


# Decodes sorted by length (one exactly on a block boundary), a fresh prompt, a chunk
# whose cached context ends mid-block, a 1-token context, and a long chunk at an odd offset.
MIXED = [(0, 1), (15, 1), (31, 1), (70, 1), (0, 9), (21, 7), (1, 2), (37, 19)]


@pytest.mark.parametrize(
    "block_size,heads,kv_heads,head_dim",
    [
        (16, 8, 2, 64),  # GQA 4
        (32, 4, 4, 32),  # MHA, the tiny qwen3's head_dim
        (64, 6, 2, 24),  # GQA 3 (padded group), odd head_dim
        (16, 8, 1, 128),  # GQA 8
    ],
)
def test_mixed_batch_matches_dense_and_torch_in_float32(block_size, heads, kv_heads, head_dim):
    batch = paged_batch(MIXED, block_size, heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    out = run_backend(
        TritonPagedAttention(CPU, heads, kv_heads, head_dim, torch.float32), batch, scale
    )
    check_dense(out, batch, MIXED, scale, atol=1e-5, rtol=1e-5)
    cache, _, _, q, k, v, meta = batch
    torch_out = run_backend(TorchPagedAttention(CPU), batch, scale)
    torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)


def test_block_size_256_with_shared_prefix_blocks():
    # Two chunks share their first block (a prefix hit); both cross into a second block.
    seqs = [(30, 1), (300, 1), (256, 5), (260, 40)]
    batch = paged_batch(seqs, 256, 4, 2, 64, shared_blocks=1)
    scale = 0.125
    out = run_backend(TritonPagedAttention(CPU, 4, 2, 64, torch.float32), batch, scale)
    check_dense(out, batch, seqs, scale, atol=1e-5, rtol=1e-5)
    tables = batch[-1].block_tables_host
    assert tables[2, 0] == tables[3, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_match_dense(dtype):
    seqs = [(3, 1), (40, 1), (17, 6)]
    batch = paged_batch(seqs, 16, 4, 2, 64, dtype=dtype)
    out = run_backend(TritonPagedAttention(CPU, 4, 2, 64, dtype), batch, 0.125)
    assert out.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    check_dense(out, batch, seqs, 0.125, atol=tol, rtol=tol)


def test_split_k_decode_matches_dense():
    # Few sequences, long contexts: forced into 4 splits (some of them empty for the
    # shortest sequence), then merged.
    seqs = [(5, 1), (200, 1), (333, 1)]
    backend = TritonPagedAttention(
        CPU, 4, 2, 32, torch.float32, target_programs=32, min_split_tokens=100
    )
    batch = paged_batch(seqs, 16, 4, 2, 32)
    backend.prepare(batch[-1])
    assert batch[-1].backend_state.num_splits == 2
    backend.min_split_tokens = 40
    out = run_backend(backend, batch, 0.2)
    assert batch[-1].backend_state.num_splits == 4
    check_dense(out, batch, seqs, 0.2, atol=1e-5, rtol=1e-5)


def test_split_count_follows_batch_and_length():
    b = TritonPagedAttention(CPU, 32, 8, 128, torch.bfloat16, target_programs=264)
    assert b.num_splits(1, 100) == 1  # short: not worth a second pass
    assert b.num_splits(1, 8192) == 16  # one long sequence: 8 KV heads x 16 splits
    assert b.num_splits(4, 8192) == 8
    assert b.num_splits(64, 8192) == 1  # enough programs without splitting
    assert b.num_splits(0, 0) == 1


@pytest.mark.parametrize("kv_write", ["triton", "index_copy"])
def test_new_rows_land_in_their_slots_and_nowhere_else(kv_write):
    seqs = [(5, 1), (0, 20)]
    cache, _, _, q, k, v, meta = paged_batch(seqs, 16, 2, 2, 24)
    before = cache.clone()
    backend = TritonPagedAttention(CPU, 2, 2, 24, torch.float32, kv_write=kv_write)
    backend.write_kv(k, v, cache, meta.slot_mapping)
    flat = cache.view(2, -1, 2, 24)
    torch.testing.assert_close(flat[0, meta.slot_mapping], k, rtol=0, atol=0)
    torch.testing.assert_close(flat[1, meta.slot_mapping], v, rtol=0, atol=0)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[meta.slot_mapping] = False
    assert torch.equal(flat[:, untouched], before.view(2, -1, 2, 24)[:, untouched])


def test_unsupported_shapes_are_refused_clearly():
    with pytest.raises(ValueError, match="head_dim 512 is over 256"):
        TritonPagedAttention(CPU, 4, 4, 512, torch.float32)
    with pytest.raises(ValueError, match="6 query heads do not split over 4 KV heads"):
        TritonPagedAttention(CPU, 6, 4, 64, torch.float32)
    with pytest.raises(ValueError, match="dtype torch.float64 is not supported"):
        TritonPagedAttention(CPU, 4, 4, 64, torch.float64)
    with pytest.raises(ValueError, match="the attention shape was not given"):
        select_backend("triton", CPU, 16, torch.float32)
    chosen = select_backend("triton", CPU, 16, torch.float32, shape=(4, 2, 32))
    assert chosen.name == "triton" and chosen.supports_cuda_graphs


class FakeGraph:
    """Stands in for a CUDA graph on CPU: capture records every kernel launch the backend
    makes (kernel, grid, the argument objects); replay launches them again as recorded, so
    the tensors they read must be the static buffers, updated in place, as under a real
    graph. Host-side values read at capture stay frozen, as they would on the GPU."""

    def __init__(self, backend):
        self.backend = backend
        self.calls = []

    def capture(self, fn):
        launch = self.backend.launch

        def record(kernel, grid, *args, **kw):
            self.calls.append((kernel, grid, args, kw))
            launch(kernel, grid, *args, **kw)

        self.backend.launch = record
        try:
            return fn()
        finally:
            self.backend.launch = launch

    def replay(self):
        for kernel, grid, args, kw in self.calls:
            kernel[grid](*args, **kw)


def test_decode_graph_replays_new_batches_through_static_buffers():
    heads, kv_heads, head_dim, bs = 4, 2, 32, 16
    backend = TritonPagedAttention(
        CPU, heads, kv_heads, head_dim, torch.float32, target_programs=64, min_split_tokens=32
    )
    size = 4  # the bucket; batches of 3 are padded
    bufs = DecodeGraphBuffers.allocate(size, 8 * bs, bs, scratch_block=40, device=CPU)
    cache = torch.zeros(2, 41, bs, kv_heads, head_dim)
    q = torch.zeros(size, heads, head_dim)
    k = torch.zeros(size, kv_heads, head_dim)
    v = torch.zeros(size, kv_heads, head_dim)
    meta = bufs.metadata(size)
    backend.prepare_graph(meta)
    assert meta.backend_state.num_splits == 4  # fixed by the bucket and max length only
    graph = FakeGraph(backend)
    out = graph.capture(lambda: backend.forward(q, k, v, cache, meta, 0.2))
    assert [c[0].__name__ for c in graph.calls] == [
        "write_kv_kernel",
        "paged_attention_kernel",
        "combine_splits_kernel",
    ]
    for seed, seqs in enumerate([[(2, 1), (20, 1), (100, 1)], [(0, 1), (47, 1), (120, 1)]]):
        new = paged_batch(seqs, bs, heads, kv_heads, head_dim, seed=seed + 1)
        new_cache, full_k, full_v, nq, nk, nv, nmeta = new
        assert new_cache.shape[1] <= 41
        cache.zero_()
        cache[:, : new_cache.shape[1] - 1] = new_cache[:, :-1]
        bufs.load(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), nmeta, size)
        q[:3], k[:3], v[:3] = nq, nk, nv
        graph.replay()
        check_dense(out[:3], (cache, full_k, full_v, nq, nk, nv, nmeta), seqs, 0.2, 1e-5, 1e-5)
        # The padding row wrote only into the scratch block.
        assert int(bufs.slot_mapping[3]) == 40 * bs and int(bufs.seq_lens[3]) == 1


def test_torch_backend_refuses_graph_capture():
    meta = DecodeGraphBuffers.allocate(2, 32, 16, 3, CPU).metadata(2)
    with pytest.raises(NotImplementedError, match="torch attention backend cannot be"):
        TorchPagedAttention(CPU).prepare_graph(meta)


# -- a whole model through the engine ----------------------------------------------------

MAX_NEW = 5
VOCAB = 384
# Lengths around the block size, two sharing a 20-token prefix (a prefix-cache hit).
PROMPTS = random_prompts(11, VOCAB, [1, 15, 17, 40], 20, [7, 27])
MODELS = {
    # GQA 4:1 with head_dim 24 (not a power of two), attention biases.
    "llama_gqa": (
        "llama",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=24, attention_bias=True),
    ),
    "qwen3": ("qwen3", None),  # GQA 2, head_dim 32, q/k norm
    "qwen2": ("qwen2", None),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return lazy_reference_models(tmp_path_factory, MODELS, PROMPTS, MAX_NEW, VOCAB)


def engine_tokens(path, warm_prompt=None, **kw):
    from pagectl.engine.args import EngineArgs
    from pagectl.engine.builder import build_engine

    args = EngineArgs(
        model=str(path), dtype="float32", device="cpu", attention_backend="triton", **kw
    )
    built = build_engine(args)
    try:
        assert built.core.executor.backend.name == "triton"
        assert built.core.model_info.attention_backend == "triton"
        if warm_prompt is not None:  # computed first: later prompts sharing it hit the cache
            engine_greedy(built.core, [warm_prompt], 1, prefix="warm")
        out = engine_greedy(built.core, PROMPTS, MAX_NEW)
        assert built.core.scheduler.kv.pool.num_used_blocks == 0
        out["preemptions"] = built.core.scheduler.counters.preemptions
        return out
    finally:
        built.shutdown()


def test_engine_with_triton_backend_matches_transformers(models):
    # Chunked prefill at an odd budget: chunks start mid-block and read cached context.
    path, reference = models("llama_gqa")
    out = engine_tokens(
        path, PROMPTS[-1], block_size=16, num_kv_blocks=48, max_num_batched_tokens=23
    )
    assert out["tokens"] == reference
    # The prompt sharing the warm prompt's 20-token prefix reads its first block from the
    # cache; the warm prompt itself (47 tokens) both of its full blocks.
    assert out["num_cached_tokens"] == [0, 0, 0, 0, 16, 32]


@pytest.mark.extended
@pytest.mark.parametrize(
    "name,kw",
    [
        ("qwen3", dict(block_size=32, num_kv_blocks=24)),
        ("qwen2", dict(block_size=64, num_kv_blocks=12, max_num_batched_tokens=37)),
        ("qwen3", dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=64)),  # preempts
    ],
)
def test_engine_with_triton_backend_matches_transformers_more(models, name, kw):
    path, reference = models(name)
    out = engine_tokens(path, **kw)
    assert out["tokens"] == reference
    assert (out["preemptions"] > 0) == (kw["num_kv_blocks"] == 16)


class FakeGraphApi:
    """``CudaGraphApi`` on CPU: a graph is the captured forward itself, replayed by calling
    it again over the same static buffers and metadata (the backend state fixed at capture,
    the host-side arrays describing padding only) and copying into the captured output, so
    a backend that read anything but the static device tensors would go wrong here."""

    def __init__(self):
        self.replays = 0
        self.captured = []

    def new_graph(self):
        api = self

        class Graph:
            def replay(self):
                api.replays += 1
                self.out.copy_(self.fn())

        return Graph()

    def capture(self, graph, pool, fn):
        graph.fn, graph.out = fn, fn()
        self.captured.append(graph.out.shape[0])
        return graph.out

    def pool(self, graph):
        return None

    def synchronize(self, device):
        pass

    def free_memory(self, device):
        return 0


def test_engine_decode_through_fake_cuda_graphs_matches_transformers(models):
    from pagectl.engine.args import EngineArgs
    from pagectl.engine.builder import build_engine
    from pagectl.engine.runner.cuda_graph import DecodeCudaGraphs

    path, reference = models("llama_gqa")
    args = EngineArgs(
        model=str(path), dtype="float32", device="cpu", attention_backend="triton",
        block_size=16, num_kv_blocks=40, max_model_len=128,
    )  # fmt: skip
    built = build_engine(args)
    try:
        runner = built.core.executor
        api = FakeGraphApi()
        runner.cuda_graphs = DecodeCudaGraphs(runner, max_batch_size=4, api=api)
        runner.cuda_graphs.capture()
        assert api.captured == [4, 2, 1]  # largest first
        # Three prompts decode together (bucket 4, one padding row), then fewer.
        prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[4]]
        out = engine_greedy(built.core, prompts, MAX_NEW)
        assert out["tokens"] == [reference[0], reference[2], reference[4]]
        assert api.replays >= MAX_NEW - 1
        # Padding rows wrote only into the scratch block; it is no sequence's.
        assert built.core.scheduler.kv.pool.num_used_blocks == 0
    finally:
        built.shutdown()
