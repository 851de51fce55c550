"""Small replicated layers: RMSNorm (with a fused residual add) and SiLU-and-mul.

On CPU, ``use_cpu_ops(ops)`` (called through the model's ``pack_for_cpu``) switches both to
the project's fused C++ ops (``attention/csrc/decode_ops_cpu.cpp``): the residual add and the
norm in one pass, in place, and SiLU-and-mul in one op, where the torch path dispatches two
to four ops and allocates their temporaries (a decode step's rows are too small for the
arithmetic to matter). ``HasFusedCpuOp`` is that switch, shared with the attention module's
q/k norm + rotary.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagectl.engine.models.weights import default_weight_loader, set_weight_loader

# The dtypes the fused CPU ops compute in.
FUSED_CPU_DTYPES = (torch.float32, torch.bfloat16)


class HasFusedCpuOp:
    """Mixin for a module whose forward has a fused CPU op (``decode_ops_cpu.cpp``).

    ``use_cpu_ops(ops)`` sets ``fused_op`` to ``ops.<fused_op_name>`` when ``fits_fused_op()``
    holds, else to None. Whether the op applies depends only on how the module was built
    (dtype, head layout), so it is decided here, once; the forward tests ``fused_op`` alone and
    hands the op the decoder's activations as they come: [T, width] rows, contiguous, in the
    module's dtype (what the linear layers and the embedding return; the op checks its operands
    and raises on any others).
    """

    # The op's name in ``torch.ops.pagectl_cpu``.
    fused_op_name: ClassVar[str]
    # The op the forward calls instead of its torch ops; None: the torch path.
    fused_op: Any = None

    def use_cpu_ops(self, ops: Any) -> None:
        self.fused_op = getattr(ops, self.fused_op_name) if self.fits_fused_op() else None

    def fits_fused_op(self) -> bool:
        """Whether the fused op can compute this module's forward."""
        raise NotImplementedError


class RMSNorm(HasFusedCpuOp, nn.Module):
    """x / rms(x) * weight, computed in float32 as transformers does.

    ``forward(x, residual)`` first adds ``residual`` and returns ``(normed, x + residual)``,
    the pre-norm decoder's "add then normalise" in one call (in place on both with the fused
    op: they are the step's own activations).
    """

    fused_op_name = "add_rms_norm_"

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(hidden_size, dtype=params_dtype), requires_grad=False
        )
        set_weight_loader(self.weight, default_weight_loader)

    def fits_fused_op(self) -> bool:
        return self.weight.dtype in FUSED_CPU_DTYPES

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        if self.fused_op is not None:
            self.fused_op(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self._norm(residual), residual


class SiluAndMul(HasFusedCpuOp, nn.Module):
    """silu(x[..., :d]) * x[..., d:] for x of width 2d (the fused gate | up output)."""

    fused_op_name = "silu_and_mul"

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        # The activations' dtype (None: torch's default, as for a parameter).
        self.dtype = dtype or torch.get_default_dtype()

    def fits_fused_op(self) -> bool:
        return self.dtype in FUSED_CPU_DTYPES

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_op is not None:
            return self.fused_op(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
