"""Small replicated layers: RMSNorm (with a fused residual add) and SiLU-and-mul.

On CPU, ``use_cpu_ops(ops)`` (called through the model's ``pack_for_cpu``) switches both to
the project's fused C++ ops (``attention/csrc/decode_ops_cpu.cpp``): the residual add and the
norm in one pass, in place, and SiLU-and-mul in one op, where the torch path dispatches two
to four ops and allocates their temporaries (a decode step's rows are too small for the
arithmetic to matter).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagectl.engine.models.weights import default_weight_loader, set_weight_loader


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 as transformers does.

    ``forward(x, residual)`` first adds ``residual`` and returns ``(normed, x + residual)``,
    the pre-norm decoder's "add then normalise" in one call.
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(hidden_size, dtype=params_dtype), requires_grad=False
        )
        set_weight_loader(self.weight, default_weight_loader)
        self._ops: Any = None

    def use_cpu_ops(self, ops: Any) -> None:
        self._ops = ops

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
        ops = self._ops
        if (
            ops is not None
            and x.dim() == 2
            and x.is_contiguous()
            and residual.is_contiguous()
            and x.dtype == residual.dtype == self.weight.dtype
            and x.shape == residual.shape
        ):
            # In place: x and residual are this step's own activations.
            ops.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self._norm(residual), residual


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for x of width 2d (the fused gate | up output)."""

    def __init__(self) -> None:
        super().__init__()
        self._ops: Any = None

    def use_cpu_ops(self, ops: Any) -> None:
        self._ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._ops is not None and x.dim() == 2 and x.is_contiguous():
            return self._ops.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
