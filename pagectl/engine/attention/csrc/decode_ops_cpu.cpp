// The elementwise work of a decoder layer on CPU, fused: each op below replaces three to
// nine torch ops (and their temporaries) with one pass over the rows.
//
//   add_rms_norm_(x, residual, weight, eps)   residual += x; x = rms_norm(residual) * weight
//   qk_norm_rope_(qkv, heads, head_dim, norm_weight?, eps, cos, sin)
//                                             per q and k head of each row of qkv, in place:
//                                             RMSNorm (when a weight is given), then rotary
//   silu_and_mul(x)                           silu(x[:, :d]) * x[:, d:]
//
// Registered in torch.ops.pagectl_cpu; built with the attention kernel by
// pagectl/engine/attention/cpu_build.py, called by pagectl/engine/models/layers.py and
// decoder.py. A decode step's rows are a few hundred floats each: at that size the
// dispatch and allocation of the unfused ops cost more than their arithmetic (the decode
// profile, docs/PERFORMANCE.md section 12).
//
// Arithmetic is float32. With bfloat16 tensors the values are rounded to bfloat16 where
// the model code stores them: the residual sum, the normalised value before the weight,
// each output; the rotary sum is rounded once (the unfused path rounds its two products
// too, so bfloat16 results may differ from it in the last bit).
//
// Rows go to torch's intra-op threads only when there is enough work to pay for waking
// them (more than kParallelElems elements in all): a decode step runs on the calling thread.
//
// Layouts (checked at the boundary): x, residual [T, H] contiguous; qkv [T, W] with
// contiguous rows (heads * head_dim <= W); cos, sin [T, head_dim] contiguous, the full-width
// tables of RotaryEmbedding.cos_sin_full ([cos | cos] and [-sin | sin]); norm_weight
// [heads, head_dim] contiguous; every tensor float32 or every one bfloat16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_vec_math.h"

namespace {

typedef float fvec8 __attribute__((vector_size(8 * sizeof(float))));
typedef int32_t ivec8 __attribute__((vector_size(8 * sizeof(int32_t))));
typedef uint16_t u16vec8 __attribute__((vector_size(8 * sizeof(uint16_t))));
typedef uint32_t u32vec8 __attribute__((vector_size(8 * sizeof(uint32_t))));
typedef float fvec1 __attribute__((vector_size(sizeof(float))));
typedef int32_t ivec1 __attribute__((vector_size(sizeof(int32_t))));

constexpr int64_t kParallelElems = 1 << 15;
constexpr int64_t kMaxHeadDim = 1024;

inline float rounded(float v, float) { return v; }
inline float rounded(float v, c10::BFloat16) { return static_cast<float>(c10::BFloat16(v)); }

template <typename T>
void for_rows(int64_t rows, int64_t width, const T& fn) {
  if (rows * width <= kParallelElems) {
    fn(0, rows);
    return;
  }
  const int64_t grain = std::max<int64_t>(1, kParallelElems / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, fn);
}

// Sum of squares of n floats, eight lanes at a time.
inline float sum_squares(const float* v, int64_t n) {
  float lanes[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) lanes[j] += v[i + j] * v[i + j];
  }
  float s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
            ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  for (; i < n; ++i) s += v[i] * v[i];
  return s;
}

template <typename S>
void add_rms_norm_typed(S* x, S* residual, const S* weight, int64_t rows, int64_t h,
                        float eps) {
  for_rows(rows, h, [&](int64_t begin, int64_t end) {
    std::vector<float> r(h);
    for (int64_t t = begin; t < end; ++t) {
      S* xt = x + t * h;
      S* rt = residual + t * h;
      for (int64_t i = 0; i < h; ++i) {
        r[i] = rounded(static_cast<float>(xt[i]) + static_cast<float>(rt[i]), S());
        rt[i] = static_cast<S>(r[i]);
      }
      const float inv = 1.0f / std::sqrt(sum_squares(r.data(), h) / h + eps);
      for (int64_t i = 0; i < h; ++i) {
        xt[i] = static_cast<S>(rounded(r[i] * inv, S()) * static_cast<float>(weight[i]));
      }
    }
  });
}

template <typename S>
void qk_norm_rope_typed(S* qkv, int64_t row_stride, int64_t rows, int64_t heads, int64_t d,
                        const S* norm_weight, float eps, const S* cos, const S* sin) {
  const int64_t half = d / 2;
  for_rows(rows, heads * d, [&](int64_t begin, int64_t end) {
    float v[kMaxHeadDim];
    for (int64_t t = begin; t < end; ++t) {
      const S* ct = cos + t * d;
      const S* st = sin + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        S* p = qkv + t * row_stride + h * d;
        for (int64_t i = 0; i < d; ++i) v[i] = static_cast<float>(p[i]);
        if (norm_weight != nullptr) {
          const float inv = 1.0f / std::sqrt(sum_squares(v, d) / d + eps);
          const S* w = norm_weight + h * d;
          for (int64_t i = 0; i < d; ++i) {
            v[i] = rounded(rounded(v[i] * inv, S()) * static_cast<float>(w[i]), S());
          }
        }
        // x * [cos | cos] + [x2 | x1] * [-sin | sin]
        for (int64_t i = 0; i < d; ++i) {
          const float rolled = i < half ? v[i + half] : v[i - half];
          p[i] = static_cast<S>(v[i] * static_cast<float>(ct[i]) +
                                rolled * static_cast<float>(st[i]));
        }
      }
    }
  });
}

// silu(g) = g / (1 + exp(-g)), with exp taken of -|g| only (no overflow): for g < 0 it is
// g * e / (1 + e) with e = exp(g).
template <typename V, typename IV>
inline V silu(V g) {
  const V neg_abs = g < 0 ? g : -g;
  const V e = pagectl_cpu::exp_nonpositive<V, IV>(neg_abs);
  const V num = g < 0 ? g * e : g;
  return num / (1.0f + e);
}

// Eight elements as floats, and back (bfloat16 rounded to nearest even, as c10 rounds).
inline fvec8 load8(const float* p) {
  fvec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline fvec8 load8(const c10::BFloat16* p) {
  return pagectl_cpu::bf16_to_float<fvec8, u16vec8, u32vec8>(p);
}
inline void store8(float* p, fvec8 v) { std::memcpy(p, &v, sizeof v); }
inline void store8(c10::BFloat16* p, fvec8 v) {
  pagectl_cpu::float_to_bf16<fvec8, u32vec8, u16vec8>(v, p);
}
inline fvec8 rounded8(fvec8 v, float) { return v; }
inline fvec8 rounded8(fvec8 v, c10::BFloat16) {
  c10::BFloat16 tmp[8];
  store8(tmp, v);
  return load8(tmp);
}

template <typename S>
void silu_and_mul_typed(const S* x, S* out, int64_t rows, int64_t d) {
  for_rows(rows, 2 * d, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const S* gate = x + t * 2 * d;
      const S* up = gate + d;
      S* o = out + t * d;
      int64_t i = 0;
      for (; i + 8 <= d; i += 8) {
        const fvec8 s = silu<fvec8, ivec8>(load8(gate + i));
        store8(o + i, rounded8(s, S()) * load8(up + i));
      }
      for (; i < d; ++i) {
        const fvec1 g = {static_cast<float>(gate[i])};
        const float s = silu<fvec1, ivec1>(g)[0];
        o[i] = static_cast<S>(rounded(s, S()) * static_cast<float>(up[i]));
      }
    }
  });
}

void check_dtype(const at::Tensor& t, at::ScalarType want, const char* name) {
  TORCH_CHECK(t.scalar_type() == want, name, " must have the dtype of the others");
}

}  // namespace

namespace pagectl_cpu {

void add_rms_norm_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                   double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "add_rms_norm_: x must be [T, H] contiguous");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous(),
              "add_rms_norm_: residual must be contiguous and shaped as x");
  TORCH_CHECK(weight.dim() == 1 && weight.numel() == x.size(1) && weight.is_contiguous(),
              "add_rms_norm_: weight must be [H]");
  const auto dt = x.scalar_type();
  check_dtype(residual, dt, "residual");
  check_dtype(weight, dt, "weight");
  const int64_t rows = x.size(0), h = x.size(1);
  if (dt == at::kFloat) {
    add_rms_norm_typed(x.data_ptr<float>(), residual.data_ptr<float>(),
                       weight.data_ptr<float>(), rows, h, static_cast<float>(eps));
  } else if (dt == at::kBFloat16) {
    add_rms_norm_typed(x.data_ptr<c10::BFloat16>(), residual.data_ptr<c10::BFloat16>(),
                       weight.data_ptr<c10::BFloat16>(), rows, h, static_cast<float>(eps));
  } else {
    TORCH_CHECK(false, "add_rms_norm_: float32 or bfloat16 only");
  }
}

void qk_norm_rope_(const at::Tensor& qkv, int64_t heads, int64_t head_dim,
                   const std::optional<at::Tensor>& norm_weight, double eps,
                   const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qk_norm_rope_: qkv must be [T, W]");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && head_dim <= kMaxHeadDim,
              "qk_norm_rope_: head_dim must be even and at most ", kMaxHeadDim);
  TORCH_CHECK(heads >= 0 && heads * head_dim <= qkv.size(1),
              "qk_norm_rope_: heads * head_dim exceeds the row");
  const int64_t rows = qkv.size(0);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == rows && t->size(1) == head_dim &&
                    t->is_contiguous(),
                "qk_norm_rope_: cos and sin must be [T, head_dim] contiguous");
  }
  const auto dt = qkv.scalar_type();
  check_dtype(cos, dt, "cos");
  check_dtype(sin, dt, "sin");
  const bool has_w = norm_weight.has_value() && norm_weight->defined();
  if (has_w) {
    TORCH_CHECK(norm_weight->dim() == 2 && norm_weight->size(0) == heads &&
                    norm_weight->size(1) == head_dim && norm_weight->is_contiguous(),
                "qk_norm_rope_: norm_weight must be [heads, head_dim] contiguous");
    check_dtype(*norm_weight, dt, "norm_weight");
  }
  const float e = static_cast<float>(eps);
  if (dt == at::kFloat) {
    qk_norm_rope_typed(qkv.data_ptr<float>(), qkv.stride(0), rows, heads, head_dim,
                       has_w ? norm_weight->data_ptr<float>() : nullptr, e,
                       cos.data_ptr<float>(), sin.data_ptr<float>());
  } else if (dt == at::kBFloat16) {
    qk_norm_rope_typed(qkv.data_ptr<c10::BFloat16>(), qkv.stride(0), rows, heads, head_dim,
                       has_w ? norm_weight->data_ptr<c10::BFloat16>() : nullptr, e,
                       cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(false, "qk_norm_rope_: float32 or bfloat16 only");
  }
}

void silu_and_mul_out(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [T, 2d] contiguous");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == d && out.is_contiguous(),
              "silu_and_mul: out must be [T, d] contiguous");
  check_dtype(out, x.scalar_type(), "out");
  if (x.scalar_type() == at::kFloat) {
    silu_and_mul_typed(x.data_ptr<float>(), out.data_ptr<float>(), rows, d);
  } else if (x.scalar_type() == at::kBFloat16) {
    silu_and_mul_typed(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, d);
  } else {
    TORCH_CHECK(false, "silu_and_mul: float32 or bfloat16 only");
  }
}

}  // namespace pagectl_cpu

namespace {

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [T, 2d] contiguous");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  pagectl_cpu::silu_and_mul_out(x, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagectl_cpu, m) {
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def(
      "qk_norm_rope_(Tensor(a!) qkv, int heads, int head_dim, Tensor? norm_weight, float eps, "
      "Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagectl_cpu, CPU, m) {
  m.impl("add_rms_norm_", &pagectl_cpu::add_rms_norm_);
  m.impl("qk_norm_rope_", &pagectl_cpu::qk_norm_rope_);
  m.impl("silu_and_mul", &silu_and_mul);
}
