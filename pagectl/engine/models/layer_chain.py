"""A pure decode step's decoder layers as one C++ op, on CPU.

A decode step on a small model spends as long in Python and dispatch as in attention: each
layer makes about 20 torch calls and a dozen module calls of a few microseconds each, around
matmuls of 50-300 microseconds (the decode profile, docs/PERFORMANCE.md section 12).
``torch.ops.pagectl_cpu.decode_layers_`` (``attention/csrc/decode_layers_cpu.cpp``) runs
every layer's kernels from C++ instead: the same kernels, in the same order, on the same
operands as the modules call them, so its output equals theirs bit for bit (the tests
compare the two).

``LayerChain.build`` says whether a model qualifies: every projection's forward is the
project's matmul or torch's int4 kernel alone (``PackableLinear.kernel_operands``), the
norms, SiLU and the q/k norm + rotation are the fused CPU ops, one rank, the CPU kernel
attention backend, and KV caches in the model's dtype. Anything else (oneDNN-packed
weights, tensor parallelism, another attention backend, a KV cache dtype of its own) keeps
the modules' forward; so do steps with prefill rows and steps of ``DENSE_MIN_ROWS`` rows or more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagectl.engine.attention import cpu_build
from pagectl.engine.attention.backend import AttentionBackend
from pagectl.engine.attention.cpu_kernel import CpuKernelPagedAttention
from pagectl.engine.attention.metadata import AttentionMetadata
from pagectl.engine.models.layers import RMSNorm
from pagectl.engine.models.linear import DENSE_MIN_ROWS

if TYPE_CHECKING:
    from pagectl.engine.models.decoder import DecoderForCausalLM


@dataclass
class LayerChain:
    op: Any
    # Layer 0's input norm, applied before the op as the modules apply it.
    first_norm: RMSNorm = field(repr=False)
    # 15 entries per layer, in decode_layers_cpu.cpp's order.
    params: list[torch.Tensor | None] = field(repr=False)
    kv_caches: list[torch.Tensor] = field(repr=False)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float

    @classmethod
    def build(
        cls,
        model: DecoderForCausalLM,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
    ) -> LayerChain | None:
        """The chain of ``model``'s layers over these caches, or None when the model's
        forward does anything the op does not (module docstring)."""
        layers = model.decoder_layers
        attns = model.attention_layers
        if (
            not layers
            or len(attns) != len(layers)
            or model.tp.size != 1
            or not isinstance(backend, CpuKernelPagedAttention)
            or any(c.dtype != model.dtype or not c.is_contiguous() for c in kv_caches)
        ):
            return None
        ops = cpu_build.load_cpu_ops()
        op = getattr(ops, "decode_layers_", None) if ops is not None else None
        if op is None:
            return None
        eps = attns[0].eps
        params: list[torch.Tensor | None] = []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
            norms = (layer.input_layernorm, layer.post_attention_layernorm, nxt)
            if (
                attn.fused_op is None
                or mlp.act_fn.fused_op is None
                or any(n.fused_op is None or n.eps != eps for n in norms)
                or attn.eps != eps
                or (attn.num_heads, attn.num_kv_heads, attn.head_dim)
                != (attns[0].num_heads, attns[0].num_kv_heads, attns[0].head_dim)
            ):
                return None
            qkv, o = attn.qkv_proj.kernel_operands(), attn.o_proj.kernel_operands()
            gate_up, down = mlp.gate_up_proj.kernel_operands(), mlp.down_proj.kernel_operands()
            if qkv is None or o is None or gate_up is None or down is None:
                return None
            params += [*qkv, attn._qk_norm_weight, *o, layer.post_attention_layernorm.weight]
            params += [*gate_up, *down, nxt.weight]
        a = attns[0]
        first = layers[0].input_layernorm
        return cls(
            op,
            first,
            params,
            list(kv_caches),
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            eps,
            a.scale,
        )

    @staticmethod
    def applies(input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether a step runs chained: decode rows only, fewer than the GEMM threshold."""
        return meta.all_decode and 0 < input_ids.shape[0] < DENSE_MIN_ROWS

    def run(
        self,
        embedded: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The final norm's output [T, hidden] for the step's embedded tokens (what the
        modules' forward returns). ``cos``/``sin``: the fused rotation's [T, head_dim] tables."""
        residual = embedded
        hidden = self.first_norm(embedded)
        assert isinstance(hidden, torch.Tensor)
        self.op(
            hidden,
            residual,
            self.params,
            self.kv_caches,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            cos,
            sin,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.eps,
            self.scale,
        )
        return hidden
