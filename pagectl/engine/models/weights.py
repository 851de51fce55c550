"""Reading checkpoint tensors, whole or in part.

A loaded value is either a ``torch.Tensor`` or a lazy safetensors slice (``safe_open`` ->
``get_slice``). Weight loaders read only the rows or columns their rank owns through
``read(value, dim, start, length)``, so with a lazy slice each rank reads only its shard
from disk.
"""

from __future__ import annotations

from typing import Any

import torch


def shape_of(value: Any) -> tuple[int, ...]:
    """Shape of a tensor or a safetensors slice."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return tuple(value.get_shape())


def read(
    value: Any, dim: int | None = None, start: int = 0, length: int | None = None
) -> torch.Tensor:
    """Materialise ``value``, or only ``[start, start + length)`` along ``dim``."""
    if dim is None:
        return value if isinstance(value, torch.Tensor) else value[:]
    shape = shape_of(value)
    dim = dim % len(shape)
    if length is None:
        length = shape[dim] - start
    if start < 0 or start + length > shape[dim]:
        raise ValueError(f"cannot read [{start}, {start + length}) of dim {dim} from shape {shape}")
    if isinstance(value, torch.Tensor):
        return value.narrow(dim, start, length)
    index = tuple(slice(None) for _ in range(dim)) + (slice(start, start + length),)
    return value[index]


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str = "") -> None:
    """``dst.copy_(src)`` after checking shapes (a silent broadcast would hide a mapping bug)."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"shape mismatch loading {name or 'a weight'}: checkpoint {tuple(src.shape)}, "
            f"model {tuple(dst.shape)}"
        )
    dst.copy_(src)


def set_weight_loader(param: torch.Tensor, loader: Any) -> None:
    """Attach ``loader(param, loaded, shard_id)`` to ``param`` (read by ``load_weights``)."""
    setattr(param, "weight_loader", loader)  # noqa: B010 (a dynamic attribute on purpose)


def default_weight_loader(param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
    """Copy a replicated parameter whole."""
    copy_checked(param.data, read(loaded))
