"""The decoder-only transformer shared by Llama, Qwen2 and Qwen3 (our own modules).

Pre-norm layers: RMSNorm -> attention (fused QKV, optional q/k RMSNorm per head, rotary,
paged attention) -> RMSNorm -> MLP (fused gate/up, SiLU-and-mul, down). Architectures differ
only in flags (``DecoderForCausalLM`` subclasses set them) and all layers are TP-aware.

The forward takes the whole step's packed rows (no batch dimension): ``input_ids`` and
``positions`` are ``[T]``; attention finds each row's sequence through ``AttentionMetadata``.
Logits are computed separately, only for the rows that need them.

On CPU, a pure decode step may run every layer in one C++ op instead of the modules
(``layer_chain.py``; same kernels, same operands, the same output bit for bit).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagectl.engine.attention import cpu_build
from pagectl.engine.attention.backend import AttentionBackend
from pagectl.engine.attention.metadata import AttentionMetadata
from pagectl.engine.model_config import ModelConfig
from pagectl.engine.models.embedding import ParallelLMHead, VocabParallelEmbedding
from pagectl.engine.models.layer_chain import LayerChain
from pagectl.engine.models.layers import FUSED_CPU_DTYPES, HasFusedCpuOp, RMSNorm, SiluAndMul
from pagectl.engine.models.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    PackableLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagectl.engine.models.parallel import SINGLE, TPGroup
from pagectl.engine.models.rotary import (
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_full,
    rotary_dim,
)
from pagectl.engine.models.weights import default_weight_loader
from pagectl.engine.quant.config import QuantConfig

# Checkpoint projection -> (our fused parameter, shard id inside it).
STACKED_PARAMS = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)
# Every shard a fused parameter needs before it is complete.
FUSED_SHARDS: dict[str, set] = {
    fused: {shard for _, name, shard in STACKED_PARAMS if name == fused}
    for _, fused, _ in STACKED_PARAMS
}
# Checkpoint entries that carry no weights we use.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class DecoderAttention(HasFusedCpuOp, nn.Module):
    # q/k norm (when the model has one) and the rotation in one op, in place on qkv.
    fused_op_name = "qk_norm_rope_"

    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPGroup,
        dtype: torch.dtype,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        d = cfg.head_dim
        self.head_dim = d
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            d,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            qkv_bias,
            tp,
            dtype,
        )
        self.num_heads = self.qkv_proj.num_heads  # on this rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # on this rank
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * d, cfg.hidden_size, o_bias, tp, dtype
        )
        self.dtype = dtype
        # Heads per rank in qkv's row: q | k | v.
        self._qkv_heads = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
        self.qk_norm = qk_norm
        self.eps = cfg.rms_norm_eps
        if qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        # [num_heads + num_kv_heads, head_dim]: q_norm's weight per q head, k_norm's per k head.
        self._qk_norm_weight: torch.Tensor | None = None
        self.scale = d**-0.5
        # The torch path's rotation: the four-op form when the whole head turns (the model
        # then passes full-width tables, ``RotaryEmbedding.cos_sin_full``).
        self.rotates_whole_head = rotary_dim(d, cfg.rope) == d
        self._rotate = apply_rotary_full if self.rotates_whole_head else apply_rotary
        # Bound by the runner: this layer's [2, num_blocks, block_size, kv_heads, head_dim]
        # cache and the backend that reads and writes it.
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def fits_fused_op(self) -> bool:
        # The op rotates whole heads, by [T, head_dim] tables in the activations' dtype.
        return self.rotates_whole_head and self.dtype in FUSED_CPU_DTYPES

    def process_weights_after_loading(self) -> None:
        if self.qk_norm:
            d = self.head_dim
            self._qk_norm_weight = torch.cat(
                [
                    self.q_norm.weight.expand(self.num_heads, d),
                    self.k_norm.weight.expand(self.num_kv_heads, d),
                ]
            )

    def _norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        # One normalisation over q and k heads together (as transformers: float32 math).
        w = self._qk_norm_weight
        assert w is not None, "process_weights_after_loading() was not called"
        if qk.dtype == torch.float32:
            return F.rms_norm(qk, (self.head_dim,), None, self.eps) * w
        x = qk.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * x.to(qk.dtype)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """``cos``/``sin``: [T, head_dim] with the fused op, else [T, 1, width] (the model's
        forward picks the layout)."""
        qkv = self.qkv_proj(hidden)
        t = qkv.shape[0]
        d = self.head_dim
        n_q, n_kv, _ = self._qkv_heads
        heads = qkv.view(t, n_q + 2 * n_kv, d)
        if self.fused_op is not None:
            # In place on this step's qkv: the q and k heads normalised and rotated.
            self.fused_op(qkv, n_q + n_kv, d, self._qk_norm_weight, self.eps, cos, sin)
            q, k, v = heads.split(self._qkv_heads, 1)
        else:
            # q and k heads side by side: normalised and rotated together.
            qk, v = heads.split((n_q + n_kv, n_kv), 1)
            if self.qk_norm:
                qk = self._norm_qk(qk)
            q, k = self._rotate(qk, cos, sin).split((n_q, n_kv), 1)
        assert self.backend is not None and self.kv_cache is not None, "KV cache not bound"
        out = self.backend.forward(q, k, v, self.kv_cache, meta, self.scale)
        return self.o_proj(out.view(t, self.num_heads * d))


class DecoderMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, bias: bool) -> None:
        super().__init__()
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [inter, inter], bias, tp, dtype
        )
        self.act_fn = SiluAndMul(dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, flags: dict[str, bool]):
        super().__init__()
        self.self_attn = DecoderAttention(
            cfg,
            tp,
            dtype,
            qkv_bias=flags["qkv_bias"],
            o_bias=flags["o_bias"],
            qk_norm=flags["qk_norm"],
        )
        self.mlp = DecoderMLP(cfg, tp, dtype, flags["mlp_bias"])
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, flags: dict[str, bool]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp, dtype, flags) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class DecoderForCausalLM(nn.Module):
    """Base class: subclasses set the architecture flags in ``arch_flags``."""

    # Checkpoint architecture names this class serves (the registry keys).
    architectures: tuple[str, ...] = ()

    @classmethod
    def arch_flags(cls, cfg: ModelConfig) -> dict[str, bool]:
        """qkv_bias, o_bias, mlp_bias and qk_norm for this architecture and config."""
        raise NotImplementedError

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.dtype = dtype
        # How the weights are stored (set by the loader).
        self.quant_config = QuantConfig()
        flags = self.arch_flags(cfg)
        self.model = DecoderModel(cfg, tp, dtype, flags)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        # Whether the attention layers rotate with the fused CPU op (set by pack_for_cpu):
        # the forward then passes them [T, head_dim] tables.
        self._fused_rotary = False
        # A pure decode step's layers as one C++ op (set by bind_kv_cache where it applies;
        # None: the modules' forward). Benchmarks set it to None to time the modules.
        self.layer_chain: LayerChain | None = None

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]

    @property
    def attention_layers(self) -> list[DecoderAttention]:
        return [layer.self_attn for layer in self.model.layers if isinstance(layer, DecoderLayer)]

    def bind_kv_cache(self, kv_caches: list[torch.Tensor], backend: AttentionBackend) -> None:
        """Give each attention layer its slice of the KV pool and the attention backend."""
        layers = self.attention_layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"{len(kv_caches)} KV tensors for {len(layers)} layers")
        for attn, cache in zip(layers, kv_caches, strict=True):
            attn.kv_cache = cache
            attn.backend = backend
        self.layer_chain = LayerChain.build(self, kv_caches, backend)

    def _projections(self) -> list[PackableLinear]:
        """The decoder layers' linear layers (not the LM head)."""
        return [
            m
            for m in self.model.layers.modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
        ]

    def expect_int4_checkpoint(self) -> None:
        """Before loading an AWQ/GPTQ checkpoint: every projection takes int4 tensors (the
        embedding and LM head stay float, as such checkpoints store them)."""
        for layer in self._projections():
            layer.expect_int4_checkpoint()

    def quantize(self, method: str, group_size: int, *, lm_head: bool) -> None:
        """After loading: quantize every projection (``method``: "int8" or "int4"), and the
        LM head to int8 when ``lm_head`` (int8 keeps the head's logits close for either
        method; over a large vocabulary the head is a large share of the bytes per token)."""
        for layer in self._projections():
            layer.quantize(method, group_size)
        if lm_head:
            self.lm_head.quantize("int8", group_size)

    def pack_for_cpu(self) -> int:
        """Pick each matmul layer's CPU path (the project's kernel on the plain weight, or
        oneDNN's packed layout; CPU only; see ``linear.py``), and switch
        the norms, SiLU and q/k rotation to the project's fused CPU ops when they load and
        apply (float32 and bfloat16; the rotation when it covers whole heads).

        Returns how many layers switched. Weights cannot be reloaded afterwards.
        """
        packed = 0
        for m in self.modules():
            pack = getattr(m, "pack_for_cpu", None)
            if m is not self and pack is not None and pack():
                packed += 1
        ops = cpu_build.load_cpu_ops()
        if ops is not None:
            for m in self.modules():
                if isinstance(m, HasFusedCpuOp):
                    m.use_cpu_ops(ops)
        # The layers are built alike: all of them fuse the rotation or none does.
        self._fused_rotary = any(a.fused_op is not None for a in self.attention_layers)
        return packed

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` for the packed rows of one step."""
        rot = self.rotary_emb
        lens = meta.token_seq_lens
        if self._fused_rotary:
            cos, sin = rot.cos_sin_full(positions, self.dtype, lens, head_axis=False)
        elif rot.rotates_whole_head:
            cos, sin = rot.cos_sin_full(positions, self.dtype, lens)
        else:
            cos, sin = rot.cos_sin(positions, self.dtype, lens)
        hidden = self.model.embed_tokens(input_ids)
        chain = self.layer_chain
        if chain is not None and chain.applies(input_ids, meta):
            return chain.run(hidden, cos, sin, meta)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, cos, sin, meta)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits ``[R, vocab]`` for the given hidden rows (None on TP ranks other
        than 0, which only contribute their part of the vocabulary)."""
        return self.lm_head.compute_logits(hidden)

    # -- weights --------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy checkpoint tensors (HF names) into our (fused, sharded) parameters.

        Raises ``ValueError`` naming unexpected checkpoint entries or parameters left unloaded.
        """
        params = dict(self.named_parameters())
        done: dict[str, set] = {}
        unexpected: list[str] = []
        tied = self.config.tie_word_embeddings
        for name, value in weights:
            if name.endswith(IGNORED_SUFFIXES) or (tied and name.startswith("lm_head.")):
                continue
            target, shard = name, None
            for part, fused, shard_id in STACKED_PARAMS:
                if f".{part}." in name:
                    target, shard = name.replace(f".{part}.", f".{fused}."), shard_id
                    break
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, value, shard)
            done.setdefault(target, set()).add(shard)
        if unexpected:
            raise ValueError(
                f"checkpoint has {len(unexpected)} tensors this {type(self).__name__} does not "
                f"expect (wrong architecture?), e.g. {unexpected[:5]}"
            )
        missing = []
        for name in params:
            need: set = {None}
            for fused, shards in FUSED_SHARDS.items():
                if f".{fused}." in name:
                    need = shards
            if not need <= done.get(name, set()):
                missing.append(name)
        if missing:
            raise ValueError(
                f"checkpoint lacks weights for {len(missing)} parameters, e.g. {missing[:5]}"
            )
        for attn in self.attention_layers:
            attn.process_weights_after_loading()
