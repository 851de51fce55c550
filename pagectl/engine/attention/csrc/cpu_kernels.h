// The tensor-level entry points of the CPU kernels, for the ops that chain them in C++
// (decode_layers_cpu.cpp) without a trip through the dispatcher and Python per op. Each
// checks its operands as the registered op of the same name does.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace pagectl_cpu {

// skinny_linear_cpu.cpp: out = x W^T (* scale) (+ bias); out [M, N] contiguous, x's dtype.
void skinny_linear_out(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& scale,
                       const std::optional<at::Tensor>& bias, const at::Tensor& out);

// packed_linear_cpu.cpp: W packed by pack_weight (bfloat16 [N / 64, K / 2, 64, 2], float32
// [N / 64, K, 64]) times x of its dtype; scale and bias float32 [N] or null.
// packed_linear_available(dtype) says whether this build has the kernel for dtype (bfloat16:
// AVX512-BF16; float32: AVX-512); without it the op refuses a packed weight.
bool packed_linear_available(at::ScalarType dtype);
at::Tensor pack_weight(const at::Tensor& weight);
void packed_linear_out(const at::Tensor& x, const at::Tensor& packed, const float* scale,
                       const float* bias, const at::Tensor& out);

// paged_attention_cpu.cpp: one query row per sequence, K/V read through the block table.
void paged_decode(const at::Tensor& q, const at::Tensor& kv_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                  const at::Tensor& out);

// decode_ops_cpu.cpp.
void add_rms_norm_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                   double eps);
void qk_norm_rope_(const at::Tensor& qkv, int64_t heads, int64_t head_dim,
                   const std::optional<at::Tensor>& norm_weight, double eps,
                   const at::Tensor& cos, const at::Tensor& sin);
// out [T, d] contiguous, x's dtype.
void silu_and_mul_out(const at::Tensor& x, const at::Tensor& out);

}  // namespace pagectl_cpu
