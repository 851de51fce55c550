"""Paged attention with Triton kernels (``triton_kernels.py``): K/V read in place.

Per layer and step:

1. new K/V rows are stored in their slots by ``write_kv_kernel`` (one launch for K and V);
2. decode rows (the first ``num_decodes`` sequences, one query each) run
   ``paged_attention_kernel`` with one program per (sequence, KV head); the query heads of a
   GQA group share every K/V load. With few sequences and long contexts the keys are split
   over ``num_splits`` programs per (sequence, KV head) and merged by
   ``combine_splits_kernel`` (split-K, so a batch of one still fills the GPU);
3. prefill rows (fresh prompts and chunks with cached context alike) run the same kernel over
   tiles of ``block_q`` query tokens; the tile list is built on the host in ``prepare``.

Any block size works: each key position looks its block up in the block table. Supported:
float16, bfloat16, float32 (float32 dots in IEEE precision, never TF32), head_dim up to 256
(padded to a power of two, the padding masked), any whole GQA ratio.

CUDA graphs (``prepare_graph``): the decode path reads only device tensors (sequence
lengths, block tables, slot mapping) and its launch grid depends only on the batch size, so a
captured launch replays correctly for any lengths that fit the captured block table width.

On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
``load_kernels`` before triton is imported): slow, but the same code the GPU runs, which is
how the tests check it without a GPU.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from pagectl.engine.attention.backend import AttentionBackend
from pagectl.engine.attention.metadata import AttentionMetadata

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634
_KERNELS = "pagectl.engine.attention.triton_kernels"


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def load_kernels(device: torch.device) -> ModuleType:
    """The kernels module, compiled for ``device``: the GPU on CUDA, the interpreter on CPU.

    Raises ``ValueError`` if triton is missing, or if the module was already imported for
    the other kind of device (``@triton.jit`` chooses once, at import).
    """
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the triton backend runs on cuda (or cpu, interpreted), not {device}")
    if device.type == "cpu" and _KERNELS not in sys.modules:
        _prepare_interpreter()
    try:
        import triton  # noqa: F401

        import pagectl.engine.attention.triton_kernels as triton_kernels
    except Exception as e:  # missing, or a broken install: either way unusable
        raise ValueError(f"triton is not importable ({type(e).__name__}: {e})") from None
    interpreted = type(triton_kernels.paged_attention_kernel).__name__ == "InterpretedFunction"
    if interpreted != (device.type == "cpu"):
        mode = "interpreter" if interpreted else "GPU"
        raise ValueError(
            f"the triton kernels were loaded for the {mode} in this process (TRITON_INTERPRET "
            f"is decided at import); they cannot also run on {device.type}"
        )
    return triton_kernels


def _prepare_interpreter() -> None:
    """Make the next import of triton run its interpreter.

    ``@triton.jit`` reads ``TRITON_INTERPRET`` when a function is decorated, triton's own
    helpers (``tl.sum``, ``tl.zeros``) included; if something imported triton before the
    variable was set (transformers can), those helpers are compiled-mode objects that the
    interpreter cannot call, so triton's Python modules are dropped and imported afresh (its
    native extension stays loaded: it cannot be initialised twice). Only on CPU, where
    nothing else in the process can use triton's GPU path.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    tl = sys.modules.get("triton.language")
    if tl is not None and type(tl.zeros).__name__ != "InterpretedFunction":
        for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
            if not name.startswith("triton._C"):
                del sys.modules[name]


@dataclass
class TritonAttentionState:
    # Split-K programs per (decode sequence, KV head); 1 = no split.
    num_splits: int
    # Prefill tiles: int32 [num_tiles] sequence index and first query row within it.
    tile_seq: torch.Tensor | None
    tile_q: torch.Tensor | None


class TritonPagedAttention(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    # Split-K: split only while (decode sequences x KV heads x splits) is under
    # ``target_programs``, and each split keeps at least ``min_split_tokens`` keys.
    MAX_SPLITS = 16
    MIN_SPLIT_TOKENS = 512

    def __init__(
        self,
        device: torch.device,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        kv_write: str = "triton",
        target_programs: int | None = None,
        min_split_tokens: int | None = None,
    ) -> None:
        """``kv_write``: "triton" (``write_kv_kernel``) or "index_copy" (the base class's
        torch ops); ``target_programs``/``min_split_tokens`` tune split-K (tests force it)."""
        super().__init__(device)
        problems = unsupported_reasons(num_heads, num_kv_heads, head_dim, dtype)
        if problems:
            raise ValueError("cannot use the triton attention backend: " + "; ".join(problems))
        if kv_write not in ("triton", "index_copy"):
            raise ValueError(f"kv_write must be triton or index_copy, got {kv_write!r}")
        self.kernels = load_kernels(device)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.g_pad = _pow2(self.group)
        self.head_dim_pad = max(16, _pow2(head_dim))
        self.ieee = dtype == torch.float32
        interpreted = device.type == "cpu"
        self.dot_f32 = interpreted and dtype == torch.bfloat16  # see triton_kernels.py
        self.kv_write = kv_write
        # Decode: one token per program, the group's heads as rows (tl.dot needs >= 16 rows).
        self.decode_block_m = max(16, self.g_pad)
        # Prefill: 64 rows per program = block_q tokens x the padded group.
        self.prefill_block_m = max(64, self.g_pad)
        self.block_q = self.prefill_block_m // self.g_pad
        self.tile_n = 32 if self.head_dim_pad >= 256 else 64
        # Launch options: software pipelining of the K/V tile loads keeps num_stages copies
        # in shared memory; float32 tiles are twice as large, so they pipeline less.
        self.launch_opts = dict(num_warps=4, num_stages=1 if dtype == torch.float32 else 2)
        if target_programs is None:
            if device.type == "cuda":
                sms = torch.cuda.get_device_properties(device).multi_processor_count
                target_programs = 2 * sms
            else:
                target_programs = 64
        self.target_programs = target_programs
        self.min_split_tokens = min_split_tokens or self.MIN_SPLIT_TOKENS
        # Every launch goes through ``launch`` (tests record and replay them).
        self.launch = _launch

    # -- per step ---------------------------------------------------------------------------

    def num_splits(self, num_decodes: int, max_seq_len: int) -> int:
        """Split-K programs per (decode sequence, KV head): a power of two."""
        if num_decodes == 0:
            return 1
        splits = 1
        while (
            splits < self.MAX_SPLITS
            and num_decodes * self.num_kv_heads * splits * 2 <= self.target_programs
            and max_seq_len >= splits * 2 * self.min_split_tokens
        ):
            splits *= 2
        return splits

    def prepare(self, meta: AttentionMetadata) -> None:
        nd = meta.num_decodes
        longest_decode = int(meta.seq_lens_host[nd - 1]) if nd else 0  # decodes sorted by length
        tile_seq = tile_q = None
        if meta.num_seqs > nd:
            qsl = meta.query_start_loc_host
            q_lens = qsl[nd + 1 : meta.num_seqs + 1] - qsl[nd : meta.num_seqs]
            counts = -(-q_lens // self.block_q)
            seqs = np.repeat(np.arange(nd, meta.num_seqs), counts)
            firsts = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            tile_seq = torch.from_numpy(seqs.astype(np.int32)).to(self.device, non_blocking=True)
            tile_q = torch.from_numpy((firsts * self.block_q).astype(np.int32)).to(
                self.device, non_blocking=True
            )
        meta.backend_state = TritonAttentionState(
            self.num_splits(nd, longest_decode), tile_seq, tile_q
        )

    def prepare_graph(self, meta: AttentionMetadata) -> None:
        # The split count is fixed into the captured launch: chosen from the batch size and the
        # longest sequence the graph may see, never from this step's lengths.
        meta.backend_state = TritonAttentionState(
            self.num_splits(meta.num_decodes, meta.max_seq_len), None, None
        )

    # -- per layer --------------------------------------------------------------------------

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        if self.kv_write == "index_copy":
            super().write_kv(k, v, kv_cache, slots)
            return
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_kv_heads, head_dim = k_cache.shape[-2:]
        heads_pad, dim_pad = _pow2(num_kv_heads), _pow2(head_dim)
        # About 4K elements of K (and of V) per program.
        block_t = max(1, min(64, 4096 // (heads_pad * dim_pad)))
        num_tokens = k.shape[0]
        self.launch(
            self.kernels.write_kv_kernel,
            (-(-num_tokens // block_t),),
            k,
            v,
            k_cache,
            v_cache,
            slots,
            num_tokens,
            num_kv_heads,
            head_dim,
            k_cache.shape[1],
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            BLOCK_T=block_t,
            HEADS_PAD=heads_pad,
            HEAD_DIM_PAD=dim_pad,
        )

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        state: TritonAttentionState = meta.backend_state
        t, num_heads, head_dim = q.shape
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if (num_heads, head_dim, k_cache.shape[-2]) != (
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
        ):
            raise ValueError(
                f"the triton backend was built for {self.num_heads} heads / "
                f"{self.num_kv_heads} KV heads / head_dim {self.head_dim}, got "
                f"{num_heads} / {k_cache.shape[-2]} / {head_dim}"
            )
        if k_cache.stride(-1) != 1 or q.stride(-1) != 1:
            raise ValueError("the triton backend needs a contiguous last dim in q and the cache")
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        common = (
            scale * LOG2E,
            meta.block_size,
            self.group,
            head_dim,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            meta.block_tables.stride(0),
        )
        if nd:
            splits = state.num_splits
            parts: tuple[torch.Tensor, ...] = (out, out, out)  # unused without splits
            if splits > 1:
                shape = (nd, num_heads, splits)
                parts = (
                    torch.empty(*shape, self.head_dim_pad, dtype=torch.float32, device=q.device),
                    torch.empty(shape, dtype=torch.float32, device=q.device),
                    torch.empty(shape, dtype=torch.float32, device=q.device),
                )
            self.launch(
                self.kernels.paged_attention_kernel,
                (nd, self.num_kv_heads, splits),
                q,
                k_cache,
                v_cache,
                out,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                meta.seq_lens,  # tile arrays: unused for decode rows
                meta.seq_lens,
                *parts,
                *common,
                DECODE=True,
                BLOCK_Q=1,
                G_PAD=self.g_pad,
                BLOCK_M=self.decode_block_m,
                HEAD_DIM_PAD=self.head_dim_pad,
                TILE_N=self.tile_n,
                NUM_SPLITS=splits,
                IEEE=self.ieee,
                DOT_F32=self.dot_f32,
                **self.launch_opts,
            )
            if splits > 1:
                self.launch(
                    self.kernels.combine_splits_kernel,
                    (nd, num_heads),
                    out,
                    *parts,
                    head_dim,
                    out.stride(0),
                    out.stride(1),
                    NUM_SPLITS=splits,
                    HEAD_DIM_PAD=self.head_dim_pad,
                )
        if state.tile_seq is not None:
            assert state.tile_q is not None
            self.launch(
                self.kernels.paged_attention_kernel,
                (state.tile_seq.shape[0], self.num_kv_heads, 1),
                q,
                k_cache,
                v_cache,
                out,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                state.tile_seq,
                state.tile_q,
                out,
                out,
                out,
                *common,
                DECODE=False,
                BLOCK_Q=self.block_q,
                G_PAD=self.g_pad,
                BLOCK_M=self.prefill_block_m,
                HEAD_DIM_PAD=self.head_dim_pad,
                TILE_N=self.tile_n,
                NUM_SPLITS=1,
                IEEE=self.ieee,
                DOT_F32=self.dot_f32,
                **self.launch_opts,
            )
        return out


def _launch(kernel: Any, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
    kernel[grid](*args, **constexprs)


def unsupported_reasons(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> list[str]:
    """Why the triton backend cannot run this attention shape (empty when it can)."""
    reasons = []
    if dtype not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {dtype} is not supported (float16, bfloat16 or float32)")
    if head_dim > MAX_HEAD_DIM:
        reasons.append(f"head_dim {head_dim} is over {MAX_HEAD_DIM}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        reasons.append(f"{num_heads} query heads do not split over {num_kv_heads} KV heads")
    return reasons
