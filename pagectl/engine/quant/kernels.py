"""Weight-only int8 and int4 matmuls on CPU with torch's own kernels.

- int8: per output channel, symmetric: ``w[n, k] = q[n, k] * scale[n]`` with ``q`` in
  [-127, 127]; ``torch._weight_int8pack_mm``.
- int4: group-wise, asymmetric (the "tinygemm" form): for input features ``k`` in group
  ``g = k // G``, ``w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]`` with ``q`` in [0, 15];
  ``torch._convert_weight_to_int4pack_for_cpu`` + ``torch._weight_int4pack_mm_for_cpu``.
  The kernel needs ``G`` in (32, 64, 128, 256) and output features divisible by 16.

torch's kernels take their activations in ``KERNEL_DTYPE`` (bfloat16): on this project's
CPUs their float32 variants are 3-10x slower (measured, docs/PERFORMANCE.md), so a float32
model casts a layer's input to bfloat16 and the output back. Scales are stored rounded to
bfloat16 (the kernels require the activation dtype).

int8 prefers the project's own CPU kernel, ``torch.ops.pagectl_cpu.skinny_linear``
(``attention/csrc/skinny_linear_cpu.cpp``, built with the attention kernel; on an AVX-512
CPU the weight is packed for ``packed_linear_cpu.cpp`` first): it reads the int8 weight,
takes float32 or bfloat16 activations as they are and accumulates in float32, and is faster than ``_weight_int8pack_mm`` at every batch size
measured (docs/PERFORMANCE.md). torch's kernel is the fallback where that library cannot be
built. Either way a quantized layer computes its dequantized weight (``dequantize()``)
applied to its input, accumulated in float32: the input rounded to bfloat16 first on the
fallback path, as it is.
"""

from __future__ import annotations

import torch

from pagectl.engine import huge_pages
from pagectl.engine.attention import cpu_build

KERNEL_DTYPE = torch.bfloat16
INT4_GROUP_SIZES = (256, 128, 64, 32)
# The int4 kernel's packing parameter (inner K tiles); 1 is valid for every group size.
_INNER_K_TILES = 1


class Int8Weight:
    """An int8 weight ``[N, K]`` with one scale per output row."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        # int8 [N, K]; or, where the project's packed kernel runs (an AVX-512 CPU, N a
        # multiple of 64), int8 [N / 64, K, 64] in its layout (``pack_weight``).
        self.q = q.contiguous()
        self.scale = scale.to(KERNEL_DTYPE).contiguous()  # [N]
        self.out_features, self.in_features = q.shape
        # The project kernel (None: torch's), and the same scales in float32 for it.
        cpu = self.q.device.type == "cpu" and q.shape[1] % 8 == 0
        self._ops = cpu_build.load_cpu_ops() if cpu else None
        self.scale_f32 = self.scale.float()
        ops = self._ops
        self.is_packed = (
            ops is not None
            and q.shape[0] % 64 == 0
            and bool(ops.packed_linear_available(torch.int8))
        )
        # The weight a step streams, on huge pages (one copy: the packed one where it packs).
        self.q = huge_pages.rehome(
            ops.pack_weight(self.q) if ops is not None and self.is_packed else self.q
        )

    @classmethod
    def quantize(cls, w: torch.Tensor, row_absmax: torch.Tensor | None = None) -> Int8Weight:
        """``row_absmax`` [N]: the largest |w| of each whole output row, when ``w`` holds only
        some of its input features (a row-parallel shard); default: ``w``'s own."""
        w = w.float()
        if row_absmax is None:
            row_absmax = w.abs().amax(dim=1)
        scale = (row_absmax.float() / 127).clamp(min=1e-12)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scale)

    def plain(self) -> torch.Tensor:
        """The int8 weight as [N, K] (a copy when it is packed)."""
        if not self.is_packed:
            return self.q
        return self.q.permute(0, 2, 1).reshape(self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return self.plain().float() * self.scale.float()[:, None]

    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()

    def kernel_operands(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(int8 weight, plain or packed, and float32 scales) as ``matmul`` hands them to
        the project's kernel, or None when it takes torch's kernel."""
        return (self.q, self.scale_f32) if self._ops is not None else None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w^T`` for 2-D ``x``, in ``x``'s dtype."""
        if self._ops is not None and x.dtype in (torch.float32, torch.bfloat16):
            return self._ops.skinny_linear(x, self.q, self.scale_f32, None)
        y = torch._weight_int8pack_mm(x.to(KERNEL_DTYPE), self.q, self.scale)
        return y if x.dtype == KERNEL_DTYPE else y.to(x.dtype)


def int4_group_for(k: int, preferred: int) -> int:
    """The kernel group size for ``k`` input features: ``preferred`` if it divides ``k``, else
    the largest kernel size that does. ``ValueError`` when none does."""
    for g in (preferred, *INT4_GROUP_SIZES):
        if g in INT4_GROUP_SIZES and k % g == 0:
            return g
    raise ValueError(f"int4 needs input features divisible by 32, got {k}")


class Int4Weight:
    """A group-wise int4 weight ``[N, K]`` in the CPU kernel's packed layout."""

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
    ) -> None:
        """``q``: integer ``[N, K]`` in [0, 15]; ``scale`` and ``zero``: ``[N, K / group_size]``
        (tinygemm form, see the module docstring)."""
        n, k = q.shape
        if n % 16:
            raise ValueError(f"int4 needs output features divisible by 16, got {n}")
        if group_size not in INT4_GROUP_SIZES or k % group_size:
            raise ValueError(f"int4 group size {group_size} does not fit {k} input features")
        if tuple(scale.shape) != (n, k // group_size) or scale.shape != zero.shape:
            raise ValueError(f"int4 scales {tuple(scale.shape)} do not fit a [{n}, {k}] weight")
        self.group_size = group_size
        self.out_features = n
        self.in_features = k
        self.packed = huge_pages.rehome(
            torch._convert_weight_to_int4pack_for_cpu(
                q.to(torch.int32).contiguous(), _INNER_K_TILES
            )
        )
        # [K / G, N, 2]: (scale, zero) per group and output feature, as the kernel reads them.
        self.scales_and_zeros = (
            torch.stack([scale.float(), zero.float()], dim=-1)
            .transpose(0, 1)
            .contiguous()
            .to(KERNEL_DTYPE)
        )

    @classmethod
    def quantize(cls, w: torch.Tensor, group_size: int) -> Int4Weight:
        """Min/max asymmetric quantization of a float weight, per group of input features."""
        n, k = w.shape
        g = group_size
        if g not in INT4_GROUP_SIZES or k % g:
            raise ValueError(f"int4 group size {g} does not fit {k} input features")
        groups = w.float().reshape(n, k // g, g)
        lo = groups.amin(dim=-1)
        hi = groups.amax(dim=-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15)
        # (q - 8) * scale + zero == q * scale + lo
        return cls(q.reshape(n, k).to(torch.uint8), scale, lo + 8 * scale, g)

    @classmethod
    def from_fine_groups(
        cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
    ) -> Int4Weight:
        """From scales given per 32 input features (checkpoint int4, see ``checkpoint.py``):
        the largest kernel group over which they are constant, so nothing is rounded anew."""
        n, k = q.shape
        for g in INT4_GROUP_SIZES:
            r = g // 32
            if k % g:
                continue
            s = scale.reshape(n, k // g, r)
            z = zero.reshape(n, k // g, r)
            if torch.equal(s, s[..., :1].expand_as(s)) and torch.equal(z, z[..., :1].expand_as(z)):
                return cls(q, s[..., 0], z[..., 0], g)
        raise AssertionError("unreachable: group 32 always fits scales given per 32 features")

    def dequantize(self) -> torch.Tensor:
        """The float weight ``[N, K]`` the kernel multiplies by (for tests and checks)."""
        # The float32 kernel on the identity: exact (q - 8) * scale + zero, no output rounding.
        eye = torch.eye(self.in_features)
        sz = self.scales_and_zeros.float()
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, sz).t()

    def nbytes(self) -> int:
        sz = self.scales_and_zeros
        return self.packed.numel() * self.packed.element_size() + sz.numel() * sz.element_size()

    def kernel_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed weight, scales and zeros) as ``matmul`` hands them to torch's kernel (the
        group size is K over the scales' first dim)."""
        return self.packed, self.scales_and_zeros

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w^T`` for 2-D ``x``, in ``x``'s dtype."""
        y = torch._weight_int4pack_mm_for_cpu(
            x.to(KERNEL_DTYPE), self.packed, self.group_size, self.scales_and_zeros
        )
        return y if x.dtype == KERNEL_DTYPE else y.to(x.dtype)


QuantizedWeight = Int8Weight | Int4Weight
