"""Rotary position embeddings with the scaling types Llama 3.x and Qwen use.

Types: default, linear, dynamic (NTK), yarn and llama3, computed as transformers computes them
(float32 inverse frequencies, cos/sin multiplied by the yarn attention factor). The rotation
is the "rotate half" (GPT-NeoX) layout: the first and second halves of the rotated dims pair up.

cos/sin for positions [0, n) are cached and grown on demand; ``cos_sin`` (or, when the whole
head is rotated, ``cos_sin_full``) is called once per forward and shared by every layer. Only
the table pair that layout reads is built: full width (``[cos | cos]``, ``[-sin | sin]``) when
the whole head is rotated, half width otherwise; the other method still answers, from views or
a concatenation of that pair. Dynamic NTK rescales by sequence length: a token is rotated
with the frequencies for the length of its sequence at the end of the step that computes it
(transformers' rule for one sequence: the longest position in the forward decides), so within
the pre-trained length it equals the default rotation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagectl.engine.model_config import RopeConfig


def rotary_dim(head_dim: int, rope: RopeConfig) -> int:
    """How many leading dims of each head are rotated (the rest pass through)."""
    return int(head_dim * rope.partial_rotary_factor)


def base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def compute_inv_freq(
    rope: RopeConfig, dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, ``dim / 2``) and the cos/sin scaling factor."""
    kind = rope.rope_type
    if kind in ("default", "dynamic"):
        # Dynamic equals default up to the pre-trained length; longer is handled per token.
        return base_inv_freq(rope.theta, dim), 1.0
    if kind == "linear":
        return base_inv_freq(rope.theta, dim) / rope.factor, 1.0
    if kind == "llama3":
        return _llama3_inv_freq(rope, dim), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(rope, dim, max_position_embeddings)
    raise ValueError(f"unsupported rope type {kind!r}")


def _llama3_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    inv_freq = base_inv_freq(rope.theta, dim)
    factor = rope.factor
    low = rope.extra.get("low_freq_factor", 1.0)
    high = rope.extra.get("high_freq_factor", 4.0)
    old_len = rope.original_max_position_embeddings
    if old_len is None:
        raise ValueError("llama3 rope needs original_max_position_embeddings")
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by ``factor``, short ones kept; in between, blended.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    extra = rope.extra
    base = rope.theta
    factor = rope.factor
    original = rope.original_max_position_embeddings or max_pos
    attention_factor = extra.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = extra.get("mscale"), extra.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = extra.get("beta_fast") or 32
    beta_slow = extra.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if extra.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: keep the original frequency (high-frequency dims)
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _full_width(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-width tables as ``apply_rotary_full`` reads them: [cos | cos] and [-sin | sin]."""
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # ``to`` is an op even when it returns ``t`` itself: skipped for float32 models.
    return t if t.dtype == dtype else t.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position (rotation itself: ``apply_rotary``)."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_position_embeddings: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim(head_dim, rope)
        # Whether every dim of a head is rotated: the model then reads ``cos_sin_full``.
        self.rotates_whole_head = self.rotary_dim == head_dim
        self.rope = rope
        self.max_position_embeddings = max_position_embeddings
        inv_freq, self.attention_scaling = compute_inv_freq(
            rope, self.rotary_dim, max_position_embeddings
        )
        self.inv_freq = inv_freq
        # The one cached pair, float32 [positions, width]: full width ([cos | cos] and
        # [-sin | sin], width rotary_dim) when rotates_whole_head, else half width (cos and
        # sin, width rotary_dim / 2).
        width = self.rotary_dim if self.rotates_whole_head else self.rotary_dim // 2
        self._cos = torch.empty(0, width)
        self._sin = torch.empty(0, width)

    @property
    def is_dynamic(self) -> bool:
        return self.rope.rope_type == "dynamic"

    def ensure_cache(self, num_positions: int, device: torch.device | str | None = None) -> None:
        """Make the cos/sin tables cover positions [0, num_positions) on ``device``."""
        device = torch.device(device) if device is not None else self._cos.device
        if self._cos.shape[0] >= num_positions and self._cos.device == device:
            return
        n = max(num_positions, self._cos.shape[0])
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        cos = freqs.cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling
        if self.rotates_whole_head:
            cos, sin = _full_width(cos, sin)
        self._cos, self._sin = cos.to(device), sin.to(device)

    def cos_sin(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        token_seq_lens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, shaped [T, 1, rotary_dim / 2], in ``dtype``.

        ``token_seq_lens`` (dynamic NTK only) is each token's sequence length after this step;
        None when no sequence exceeds the pre-trained length.
        """
        if token_seq_lens is not None and self.is_dynamic:
            cos, sin = self._dynamic_cos_sin(positions, token_seq_lens)
        elif self.rotates_whole_head:
            # The halves of the full-width tables: [cos | cos] and [-sin | sin].
            half = self.rotary_dim // 2
            cos = self._cos[:, :half].index_select(0, positions)
            sin = self._sin[:, half:].index_select(0, positions)
        else:
            cos = self._cos.index_select(0, positions)
            sin = self._sin.index_select(0, positions)
        return _cast(cos, dtype).unsqueeze(1), _cast(sin, dtype).unsqueeze(1)

    def cos_sin_full(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        token_seq_lens: torch.Tensor | None = None,
        *,
        head_axis: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[cos | cos]`` and ``[-sin | sin]`` for each token, shaped [T, 1, rotary_dim], in
        ``dtype``: the operands of ``apply_rotary_full`` (same arguments as ``cos_sin``).
        Without ``head_axis``: contiguous [T, rotary_dim], the fused CPU op's operands."""
        if token_seq_lens is not None and self.is_dynamic:
            cos, sin = self._dynamic_cos_sin(positions, token_seq_lens)
            cos, sin = _full_width(cos, sin)
        else:
            cos = self._cos.index_select(0, positions)
            sin = self._sin.index_select(0, positions)
            if not self.rotates_whole_head:  # half-width tables
                cos, sin = _full_width(cos, sin)
        cos, sin = _cast(cos, dtype), _cast(sin, dtype)
        return (cos.unsqueeze(1), sin.unsqueeze(1)) if head_axis else (cos, sin)

    def _dynamic_cos_sin(
        self, positions: torch.Tensor, token_seq_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dim = self.rotary_dim
        max_pos = self.max_position_embeddings
        factor = self.rope.factor
        seq_len = token_seq_lens.clamp(min=max_pos).float()
        base = self.rope.theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        exponents = (
            torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim
        )
        inv_freq = 1.0 / (base[:, None] ** exponents[None, :])
        freqs = positions.float()[:, None] * inv_freq
        return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] (any row stride) by per-row ``cos``/``sin``
    [T, 1, rotary_dim / 2]; dims past ``rotary_dim`` pass through. Returns a new tensor."""
    half = cos.shape[-1]
    rotary_dim = 2 * half
    x1 = x[..., :half]
    x2 = x[..., half:rotary_dim]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if rotary_dim < x.shape[-1]:
        parts.append(x[..., rotary_dim:])
    return torch.cat(parts, dim=-1)


def apply_rotary_full(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` when the whole head is rotated, in four ops instead of nine:
    ``x * [cos | cos] + roll(x) * [-sin | sin]``, where ``roll`` swaps the halves
    (``[x2 | x1]``). Bit for bit the same values: each half is the same two products added
    in the same order (``x1 * cos + x2 * -sin`` equals ``x1 * cos - x2 * sin`` exactly).
    ``cos``/``sin``: ``RotaryEmbedding.cos_sin_full``'s [T, 1, head_dim]."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
