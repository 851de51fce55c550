"""Tensor-parallel linear layers (Megatron style), with per-parameter weight loaders.

- ``ColumnParallelLinear``: the output features are split across ranks; no communication.
- ``MergedColumnParallelLinear``: several column-parallel projections of the same input in one
  matmul (gate and up). Each piece is split across ranks on its own, so a rank's slice of the
  fused output is [its gate rows | its up rows].
- ``QKVParallelLinear``: q, k and v in one matmul; heads are split across ranks, and KV heads
  are replicated when there are fewer of them than ranks.
- ``RowParallelLinear``: the input features are split; partial outputs are summed with an
  all-reduce (a no-op at tp size 1) and the bias is added once, after the sum.

Every parameter carries ``weight_loader(param, loaded, shard_id)``, which copies this rank's
part of a checkpoint tensor (or lazy slice) into it. Parameters are created uninitialised:
the loader fills all of them.

On CPU, ``pack_for_cpu()`` (called by the runner after loading) picks each layer's matmul.
On an AVX-512 CPU a float32 weight (bfloat16 too where the CPU has AVX512-BF16) whose output
features are whole tiles of 64 moves into the project kernel's packed layout (``pack_weight``,
``packed_linear_cpu.cpp``) and the plain copy is freed; that kernel takes every row count
(faster than the plain kernel, oneDNN and torch's GEMM from 1 to 512 rows on the 0.6B
shape). Otherwise a float32 or bfloat16 weight stays in its plain [N, K] layout when the
project's kernel (``torch.ops.pagectl_cpu.skinny_linear``) loads, and the kernel multiplies
by it (bfloat16 widened to float32 in registers) below ``DENSE_MIN_ROWS`` rows; from there
torch's GEMM takes over (a bfloat16 or int8 weight widened to float32 a slice at a time).
Against oneDNN's packed float32 matmul, the path without the kernel, the plain kernel is
1.3x (33.6M model) to 1.6x (0.6B shape) faster at one row on an AVX2 CPU, 1.2-1.4x at 16 and
32, level to 0.85x between 64 and 127, and GEMM is 0.75-0.85x of oneDNN at 128 and 512 rows
(docs/PERFORMANCE.md, section 12). Without the kernel, a float32 weight (and a bfloat16 one
where oneDNN takes it: a CPU with native bfloat16 instructions) moves into oneDNN's blocked
layout and the plain copy is freed.

Weight-only quantization (``pagectl/engine/quant``) replaces a layer's weight after loading:
``quantize()`` turns this rank's float shard into int8 or int4 (so tensor-parallel shards are
quantized per rank, to exactly their part of the TP = 1 quantized weight: a row-parallel
shard's int8 scales come from the whole rows, through a max over the group, and int4 groups
lie inside a rank's features whenever the group divides them), and ``expect_int4_checkpoint()`` (called before loading an AWQ or GPTQ
checkpoint) swaps the float weight for the canonical int4 tensors the checkpoint reader
yields; they shard with the same loaders, since their features lie along the same dims.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagectl.engine import huge_pages
from pagectl.engine.attention import cpu_build
from pagectl.engine.models.parallel import SINGLE, TPGroup, divide, kv_heads_per_rank
from pagectl.engine.models.weights import copy_checked, read, set_weight_loader, shape_of
from pagectl.engine.quant.checkpoint import SCALE_SPAN
from pagectl.engine.quant.kernels import (
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    int4_group_for,
)

# From this many rows on, torch's float32 GEMM takes the matmul (a bfloat16 or int8 weight
# widened to float32 a slice at a time; widening costs a small fraction of it); below, the
# project's kernel. Over the 33.6M model's 33 matmuls (LM head included), 2 threads, GEMM
# against the kernel for float32 / bf16 / int8: at 128 rows 114 / 141 / 132 against 88 / 96
# / 82 ms, at 192 140 / 205 / 140 against 131 / 169 / 131, at 320 178 / 201 / 210 against
# 204 / 217 / 207, at 512 281 / 322 / 333 against 344 / 346 / 377. Figures and command:
# docs/PERFORMANCE.md, section 12.
DENSE_MIN_ROWS = 256
# Elements of float32 weight widened at once (16 MiB).
DENSE_SLICE_ELEMS = 1 << 22
# Output features per tile of the kernel's packed layouts (packed_linear_cpu.cpp).
PACKED_TILE_COLS = 64

# What the project's kernel multiplies by: weight, scale (int8), bias.
KernelOperands = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]

# The parameters of a projection loaded from an AWQ/GPTQ checkpoint (see checkpoint.py).
_INT4_PARAMS = ("weight_int4", "weight_int4_scale", "weight_int4_zero")


def _param(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(huge_pages.empty(shape, dtype), requires_grad=False)


def pack_cpu_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` in oneDNN's blocked layout, or None when unavailable or not bit-compatible.

    Checked once on a small input against ``F.linear`` so a torch build without the oneDNN
    ops, or one that behaves differently, silently keeps the plain path.
    """
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 128)
        x = torch.randn(3, weight.shape[1], dtype=weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        want = F.linear(x, weight)
    except Exception:  # op missing or unsupported in this build
        return None
    tol = 1e-3 if weight.dtype == torch.float32 else 5e-2
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
        return None
    return packed


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W^T + b`` with W prepacked by ``pack_cpu_weight`` (2-D ``x``)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackableLinear(nn.Module):
    """Holds the optional oneDNN-packed weight of a matmul layer (the linear layers and the
    LM head)."""

    weight: nn.Parameter
    # True when another module reads ``weight`` too (a tied LM head): packing keeps it.
    weight_is_shared = False

    def __init__(self) -> None:
        super().__init__()
        self._packed: torch.Tensor | None = None
        # The project's CPU kernels, when a plain bfloat16 weight is multiplied by them.
        self._skinny: Any = None
        # Set by quantize(): the weight the matmul uses instead of ``weight``.
        self._quantized: QuantizedWeight | None = None
        # The weight in the kernel's packed layout (``weight`` is then empty).
        self._own_packed: torch.Tensor | None = None

    @property
    def quantized(self) -> QuantizedWeight | None:
        return self._quantized

    def _free_weight(self) -> None:
        if not self.weight_is_shared:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def expect_int4_checkpoint(self) -> None:
        """Replace ``weight`` [N, K] by the canonical int4 tensors of a checkpoint
        (``weight_int4`` [N, K], ``weight_int4_scale`` / ``_zero`` [N, K / 32]), loaded by
        this layer's weight loader. ``quantize()`` packs them afterwards."""
        n, k = self.weight.shape
        if k % SCALE_SPAN:
            raise ValueError(
                f"int4 checkpoint: {k} input features per rank is not a multiple of "
                f"{SCALE_SPAN} (lower the tensor-parallel size)"
            )
        loader = self.weight.weight_loader  # type: ignore[attr-defined]
        del self.weight
        shapes = {  # in _INT4_PARAMS order
            "weight_int4": ((n, k), torch.uint8),
            "weight_int4_scale": ((n, k // SCALE_SPAN), torch.float32),
            "weight_int4_zero": ((n, k // SCALE_SPAN), torch.float32),
        }
        for name, (shape, dtype) in shapes.items():
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            set_weight_loader(param, loader)
            self.register_parameter(name, param)

    def quantize(self, method: str, group_size: int) -> None:
        """Quantize this rank's weight: "int8" per output channel, "int4" in groups of
        ``group_size`` input features (or the largest kernel group dividing them). A layer
        holding checkpoint int4 tensors is packed from them whatever ``method`` says."""
        parts = self._parameters
        if "weight_int4" in parts:
            q, scale, zero = (parts[n] for n in _INT4_PARAMS)
            assert q is not None and scale is not None and zero is not None
            self._quantized = Int4Weight.from_fine_groups(q.data, scale.data, zero.data)
            for name in _INT4_PARAMS:
                p = parts[name]
                assert p is not None
                p.data = torch.empty(0, dtype=p.dtype)
            return
        w = self.weight.data
        if method == "int8":
            self._quantized = Int8Weight.quantize(w, self._int8_row_absmax(w))
        elif method == "int4":
            self._quantized = Int4Weight.quantize(w, int4_group_for(w.shape[1], group_size))
        else:
            raise ValueError(f"unknown quantization method {method!r}")
        self._packed = None
        self._free_weight()

    def _int8_row_absmax(self, w: torch.Tensor) -> torch.Tensor | None:
        """Each output row's largest |w| over the whole row (None: this shard holds whole
        rows). Row-parallel layers override it."""
        return None

    def pack_for_cpu(self, own_kernel: bool = True, packed_layout: bool = True) -> bool:
        """Switch to the CPU matmul path (module docstring); frees the plain weight when it
        moves into another layout, unless it is shared. Returns whether it switched (never
        for a quantized layer, which has its own kernel). ``own_kernel=False`` takes
        oneDNN's path wherever it packs the weight, ``packed_layout=False`` the project's
        plain kernel where it would pack (benchmarks compare the paths)."""
        if self._quantized is not None:
            return False
        if self._packed is not None or self._skinny is not None:
            return True
        w = self.weight.data
        if w.device.type != "cpu":
            return False
        fits = w.dtype in (torch.float32, torch.bfloat16) and w.shape[1] % 8 == 0
        # The kernel's packed layout where this CPU has it (AVX-512; bfloat16 also needs
        # AVX512-BF16): faster than the plain kernel and than oneDNN at every row count.
        if own_kernel and packed_layout and fits and self._pack_own(w):
            return True
        # float32 (and bfloat16 when the packed layout is declined): the plain kernel
        # whenever it loads (it reads the same bytes as oneDNN, faster).
        plain = w.dtype == torch.float32 or not packed_layout
        if own_kernel and fits and plain:
            self._skinny = cpu_build.load_cpu_ops()
            if self._skinny is not None:
                return True
        packed = pack_cpu_weight(w)
        if packed is not None:
            self._packed = packed
            self._free_weight()
            return True
        # bfloat16 that oneDNN does not pack (no bfloat16 instructions): the kernel.
        if fits and w.dtype == torch.bfloat16:
            self._skinny = cpu_build.load_cpu_ops()
        return self._skinny is not None

    def _pack_own(self, w: torch.Tensor) -> bool:
        """Move ``w`` into the kernel's packed layout (``pack_weight``: bfloat16 [N / 64,
        K / 2, 64, 2], float32 [N / 64, K, 64]) where the library has the kernel for its
        dtype and N is a multiple of 64; the plain weight is freed (a tied head hands the
        packed rows to its embedding first, ``ParallelLMHead``). Returns whether it did."""
        ops = cpu_build.load_cpu_ops()
        if ops is None or w.shape[0] % PACKED_TILE_COLS:
            return False
        if not ops.packed_linear_available(w.dtype):
            return False
        self._skinny = ops
        self._own_packed = huge_pages.rehome(ops.pack_weight(w))
        self._share_packed(self._own_packed)
        self.weight.data = torch.empty(0, dtype=w.dtype)
        return True

    def _share_packed(self, packed: torch.Tensor) -> None:
        """Called before the plain weight is freed for ``packed``; a module that shares the
        weight with another reader (a tied LM head) hands that reader the packed copy."""
        if self.weight_is_shared:
            raise RuntimeError("a shared weight cannot be packed without its other reader")

    def kernel_operands(self) -> KernelOperands | None:
        """(weight, scale, bias) exactly as this layer's forward hands them to the project's
        kernel (``skinny_linear``) below ``DENSE_MIN_ROWS`` rows, or None when its forward
        does anything else there: oneDNN's packed weight, torch's int8 kernel, a bias added
        after the matmul, a reduction across ranks. An int4 weight's operands are its packed
        tensor and scales (``Int4Weight.kernel_operands``; the op calls torch's int4 kernel as
        ``Int4Weight.matmul`` does). The model's chained decode layers (``layer_chain.py``)
        multiply by these operands instead of calling the forward."""
        return None

    def _kernel_operands(self, bias: torch.Tensor | None) -> KernelOperands | None:
        """``kernel_operands`` of a forward that is ``_matmul(x, bias)`` alone."""
        q = self._quantized
        if isinstance(q, (Int8Weight, Int4Weight)):
            operands = q.kernel_operands()
            # The quantized paths add a bias after the matmul, in the activations' dtype.
            return None if operands is None or bias is not None else (*operands, None)
        if q is None and self._own_packed is not None:
            return self._own_packed, None, bias
        if q is None and self._packed is None and self._skinny is not None:
            return self.weight, None, bias
        return None

    def _dense_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``x W^T + b`` by float32 GEMM over float32 slices of a bfloat16 or int8 weight, or
        None when this layer's weight is neither (a plain float32 weight: straight to GEMM)."""
        q = self._quantized
        if isinstance(q, Int8Weight) and q.is_packed:
            return None  # the packed kernel takes every row count
        if isinstance(q, Int8Weight):
            n = q.out_features

            def widen(a: int, b: int) -> torch.Tensor:
                return q.q[a:b].float() * q.scale_f32[a:b, None]
        elif self._skinny is not None:
            if self.weight.dtype == torch.float32:
                return F.linear(x, self.weight, bias)
            n = self.weight.shape[0]

            def widen(a: int, b: int) -> torch.Tensor:
                return self.weight[a:b].float()
        else:
            return None
        xf = x.float()
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        step = max(16, DENSE_SLICE_ELEMS // max(1, x.shape[1]))
        if step >= n:
            torch.mm(xf, widen(0, n).t(), out=out)
        else:
            for a in range(0, n, step):
                b = min(n, a + step)
                out[:, a:b] = torch.mm(xf, widen(a, b).t())
        if bias is not None:
            out += bias
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # A step's activations are 2-D: no reshapes around the kernel then (each is an op).
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if self._own_packed is not None:
            # Every row count: the packed kernel is level with oneDNN's GEMM at 512 rows.
            dtype = self._own_packed.dtype
            y = self._skinny.skinny_linear(x2.to(dtype), self._own_packed, None, bias)
            y = y if x.dtype == dtype else y.to(x.dtype)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])
        if x2.shape[0] >= DENSE_MIN_ROWS and x2.device.type == "cpu":
            y = self._dense_matmul(x2, bias)
            if y is not None:
                return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])
        if self._quantized is not None:
            y = self._quantized.matmul(x2)
            if bias is not None:
                y = y + bias
        elif self._packed is not None:
            y = packed_linear(x2, self._packed, bias)
        elif self._skinny is not None and x.dtype in (torch.float32, torch.bfloat16):
            y = self._skinny.skinny_linear(x2, self.weight, None, bias)
        else:
            return F.linear(x, self.weight, bias)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


class ColumnParallelLinear(PackableLinear):
    """y = x W^T + b with W's rows (output features) split across ranks."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TPGroup = SINGLE,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_rank = divide(output_size, tp.size, "output features")
        self.weight = _param(self.output_size_per_rank, input_size, dtype=params_dtype)
        set_weight_loader(self.weight, self.weight_loader)
        if bias:
            self.bias = _param(self.output_size_per_rank, dtype=params_dtype)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        n = param.shape[0]
        copy_checked(param.data, read(loaded, 0, self.tp.rank * n, n))

    def kernel_operands(self) -> KernelOperands | None:
        return self._kernel_operands(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel projections of one input, fused; ``shard_id`` is the piece's index."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp: TPGroup = SINGLE,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        for size in output_sizes:
            divide(size, tp.size, "output features of a fused projection")
        super().__init__(input_size, sum(output_sizes), bias, tp, params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if shard_id is None:
            raise ValueError("a fused projection is loaded piece by piece (shard_id required)")
        size = self.output_sizes[shard_id] // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        dst = param.data.narrow(0, offset, size)
        copy_checked(dst, read(loaded, 0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; ``shard_id`` is "q", "k" or "v".

    Each rank holds ``num_heads / tp`` query heads and ``max(1, num_kv_heads / tp)`` KV heads.
    With fewer KV heads than ranks, ranks ``[i * r, (i + 1) * r)`` share KV head ``i``
    (``r = tp / num_kv_heads``); that needs ``tp`` to be a multiple of ``num_kv_heads``.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: TPGroup = SINGLE,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp.size, "num_attention_heads")
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp.size)
        if num_kv_heads >= tp.size:
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            self.kv_head_start = tp.rank // (tp.size // num_kv_heads)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        # The full (unsharded) output size, as the column-parallel base expects it.
        super().__init__(
            hidden_size, (self.q_size + 2 * self.kv_size) * tp.size, bias, tp, params_dtype
        )

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp.rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, start = self.kv_size, self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"qkv shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        if shape_of(loaded)[0] < start + size:
            raise ValueError(f"checkpoint {shard_id} projection is smaller than the config says")
        copy_checked(param.data.narrow(0, offset, size), read(loaded, 0, start, size))


class RowParallelLinear(PackableLinear):
    """y = all_reduce(x_rank W_rank^T) + b with W's columns (input features) split."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TPGroup = SINGLE,
        params_dtype: torch.dtype | None = None,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size_per_rank = divide(input_size, tp.size, "input features")
        self.output_size = output_size
        self.reduce_results = reduce_results
        self.weight = _param(output_size, self.input_size_per_rank, dtype=params_dtype)
        set_weight_loader(self.weight, self.weight_loader)
        if bias:
            # Replicated: added once after the reduction.
            self.bias = _param(output_size, dtype=params_dtype)
            set_weight_loader(self.bias, self.bias_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        n = param.shape[1]
        copy_checked(param.data, read(loaded, 1, self.tp.rank * n, n))

    def bias_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        copy_checked(param.data, read(loaded))

    def _int8_row_absmax(self, w: torch.Tensor) -> torch.Tensor | None:
        # A rank holds part of each row: the scale comes from the whole row (every rank
        # quantizes its layers in the same order, so this collective pairs up), so a
        # rank's int8 weights are exactly its columns of the TP = 1 int8 weight.
        if self.tp.size == 1:
            return None
        return self.tp.all_reduce_max(w.float().abs().amax(dim=1))

    def kernel_operands(self) -> KernelOperands | None:
        # One rank and no bias: the forward is the matmul alone.
        return self._kernel_operands(None) if self.bias is None and self.tp.size == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, None)
        if self.reduce_results:
            y = self.tp.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
