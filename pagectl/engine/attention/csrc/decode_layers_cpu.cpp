// A pure decode step's decoder layers on CPU, in one op: every layer's matmuls, fused
// elementwise ops, KV write and paged attention chained in C++.
//
//   decode_layers_(hidden, residual, params, kv_caches, slot_mapping, block_tables,
//                  seq_lens, cos, sin, num_heads, num_kv_heads, head_dim, eps, scale)
//
// Registered in torch.ops.pagectl_cpu; built with the other CPU kernels by
// pagectl/engine/attention/cpu_build.py, called by pagectl/engine/models/layer_chain.py.
//
// The op runs the same kernels, in the same order and on the same operands, as the layer
// modules do when each of them calls its fused op (so its output is the modules' output,
// bit for bit); what it saves is the Python and the dispatch around them: about 20 torch
// ops and a dozen module calls per layer, each a few microseconds, which on a small model's
// single-stream step add up to as much as the attention (docs/PERFORMANCE.md, section 12).
// The activations' buffers are allocated once per call and reused by every layer.
//
// On entry ``hidden`` [T, H] is layer 0's input already normalised by its input norm and
// ``residual`` [T, H] its residual (the embedding output): the caller applies that first norm
// as the modules do. On return ``hidden`` is the final norm's output (and ``residual`` the
// last residual sum). Rows are decode rows: row i is sequence i's one new token.
//
// ``params`` holds 15 entries per layer, None where a layer has none:
//   qkv weight, qkv scale, qkv bias, q/k norm weight [heads, head_dim] (q heads then k
//   heads), o weight, o scale, o bias, post-attention norm weight, gate/up weight, gate/up
//   scale, gate/up bias, down weight, down scale, down bias, and the next norm's weight (the
//   next layer's input norm; the final norm after the last layer).
// ``eps``: every norm's (the q/k norms' included). Weights are what skinny_linear takes
// (float32, bfloat16 plain or packed, or int8 with its scale), or an int4 weight as Int4Weight holds it
// (uint8 [N, K / 2] packed by torch, its [K / group, N, 2] scales and zeros in the scale
// slot), multiplied by torch's int4 kernel as Int4Weight.matmul calls it.
// ``kv_caches``: one [2, num_blocks, block_size, num_kv_heads, head_dim] cache per layer in
// hidden's dtype; ``slot_mapping`` int64 [T]: where each row's K and V go.

#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>

#include "cpu_kernels.h"

namespace {

constexpr int64_t kPerLayer = 15;

// Copies each row's K and V heads (rows of qkv) into its slot of the layer's cache (slots
// checked by the caller).
void write_kv(const at::Tensor& qkv, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, const at::Tensor& kv_cache, const int64_t* slots) {
  const int64_t rows = qkv.size(0);
  const int64_t elem = qkv.element_size();
  const int64_t row_bytes = num_kv_heads * head_dim * elem;
  const char* src = static_cast<const char*>(qkv.const_data_ptr());
  char* k_cache = static_cast<char*>(kv_cache.mutable_data_ptr());
  char* v_cache = k_cache + kv_cache.stride(0) * elem;
  const int64_t src_stride = qkv.stride(0) * elem;
  const int64_t k_offset = num_heads * head_dim * elem;
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t s = slots[t];
    const char* row = src + t * src_stride + k_offset;
    std::memcpy(k_cache + s * row_bytes, row, row_bytes);
    std::memcpy(v_cache + s * row_bytes, row + row_bytes, row_bytes);
  }
}

const at::Tensor& required(const std::optional<at::Tensor>& t, const char* what) {
  TORCH_CHECK(t.has_value() && t->defined(), "decode_layers_: ", what, " is missing");
  return *t;
}

// One projection into out: the project's matmul, or for an int4 weight torch's int4 kernel
// with x in the scales' dtype and the result cast to out's (what Int4Weight.matmul does).
void project(const at::Tensor& x, const at::Tensor& weight,
             const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& bias,
             const at::Tensor& out) {
  if (weight.scalar_type() != at::kByte) {
    pagectl_cpu::skinny_linear_out(x, weight, scale, bias, out);
    return;
  }
  const at::Tensor& sz = required(scale, "an int4 weight's scales");
  TORCH_CHECK(!(bias.has_value() && bias->defined()),
              "decode_layers_: an int4 projection takes no bias here");
  TORCH_CHECK(sz.dim() == 3 && sz.size(0) > 0 && x.size(1) % sz.size(0) == 0,
              "decode_layers_: int4 scales must be [K / group, N, 2]");
  const int64_t group = x.size(1) / sz.size(0);
  out.copy_(at::_weight_int4pack_mm_for_cpu(x.to(sz.scalar_type()), weight, group, sz));
}

// A projection weight's output features: rows of a plain or int4 weight; N / 64 tiles of 64
// for a packed one ([N / 64, K / 2, 64, 2] or [N / 64, K, 64]).
int64_t out_features(const at::Tensor& weight) {
  return weight.dim() > 2 ? weight.size(0) * weight.size(2) : weight.size(0);
}

void decode_layers_(const at::Tensor& hidden, const at::Tensor& residual,
                    const c10::List<std::optional<at::Tensor>>& params,
                    at::TensorList kv_caches, const at::Tensor& slot_mapping,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens,
                    const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, double eps, double scale) {
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(params.size()) == kPerLayer * num_layers,
              "decode_layers_: ", kPerLayer, " params per layer expected, got ", params.size(),
              " for ", num_layers, " layers");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(),
              "decode_layers_: hidden must be [T, H] contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous() && slot_mapping.size(0) == hidden.size(0),
              "decode_layers_: slot_mapping must be int64 [T] contiguous");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0,
              "decode_layers_: head counts and head_dim must be positive");
  const int64_t rows = hidden.size(0);
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
  const auto opts = hidden.options();
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  // Every slot and cache is checked before the first layer writes anything.
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor& cache = kv_caches[l];
    TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.size(3) == num_kv_heads &&
                    cache.size(4) == head_dim && cache.is_contiguous() &&
                    cache.scalar_type() == hidden.scalar_type() &&
                    cache.size(1) == kv_caches[0].size(1) &&
                    cache.size(2) == kv_caches[0].size(2),
                "decode_layers_: layer ", l, "'s KV cache does not fit the step");
  }
  const int64_t slot_count = num_layers ? kv_caches[0].size(1) * kv_caches[0].size(2) : 0;
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < slot_count, "decode_layers_: slot ", slots[t],
                " out of range of ", slot_count, " cache slots");
  }
  // The step's activations, reused by every layer.
  const at::Tensor qkv = at::empty({rows, width}, opts);
  const at::Tensor q = qkv.view({rows, width / head_dim, head_dim}).narrow(1, 0, num_heads);
  const at::Tensor attn = at::empty({rows, num_heads, head_dim}, opts);
  const at::Tensor attn_rows = attn.view({rows, num_heads * head_dim});
  const at::Tensor mid = at::empty(hidden.sizes(), opts);
  at::Tensor gate_up, act;
  for (int64_t l = 0; l < num_layers; ++l) {
    auto p = [&](int64_t i) { return params.get(l * kPerLayer + i); };
    const at::Tensor& cache = kv_caches[l];
    const at::Tensor qkv_w = required(p(0), "a qkv weight");
    TORCH_CHECK(out_features(qkv_w) == width,
                "decode_layers_: the qkv weight's rows differ from the heads'");
    project(hidden, qkv_w, p(1), p(2), qkv);
    pagectl_cpu::qk_norm_rope_(qkv, num_heads + num_kv_heads, head_dim, p(3), eps, cos, sin);
    write_kv(qkv, num_heads, num_kv_heads, head_dim, cache, slots);
    pagectl_cpu::paged_decode(q, cache, block_tables, seq_lens, scale, attn);
    project(attn_rows, required(p(4), "an o weight"), p(5), p(6), mid);
    pagectl_cpu::add_rms_norm_(mid, residual, required(p(7), "a norm weight"), eps);
    const at::Tensor gu_w = required(p(8), "a gate/up weight");
    const int64_t gu_n = out_features(gu_w);
    if (!gate_up.defined() || gate_up.size(1) != gu_n) {
      gate_up = at::empty({rows, gu_n}, opts);
      act = at::empty({rows, gu_n / 2}, opts);
    }
    project(mid, gu_w, p(9), p(10), gate_up);
    pagectl_cpu::silu_and_mul_out(gate_up, act);
    project(act, required(p(11), "a down weight"), p(12), p(13), hidden);
    pagectl_cpu::add_rms_norm_(hidden, residual, required(p(14), "a norm weight"), eps);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagectl_cpu, m) {
  m.def(
      "decode_layers_(Tensor(a!) hidden, Tensor(b!) residual, Tensor?[] params, "
      "Tensor(c!)[] kv_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "Tensor cos, Tensor sin, int num_heads, int num_kv_heads, int head_dim, float eps, "
      "float scale) -> ()");
}

TORCH_LIBRARY_IMPL(pagectl_cpu, CPU, m) { m.impl("decode_layers_", &decode_layers_); }
