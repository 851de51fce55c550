// Causal attention for one sequence's prefill rows on CPU, with its cached context.
//
//   prefill_attention(q, k, v, context_len, scale, out)
//
// Registered in torch.ops.pagectl_cpu; built with the other CPU kernels by
// pagectl/engine/attention/cpu_build.py, called by cpu_kernel.py for every prefill row
// (torch's SDPA did it before: about 14 GMAC/s on a 288-token prompt, a quarter of a
// prefill step's time; docs/PERFORMANCE.md, section 12).
//
// Query row r (position context_len + r) attends keys 0 .. context_len + r. A work item is
// one KV head and a block of kQueryBlock query rows: the G query heads of that KV head over
// those rows, kQueryBlock * G query vectors that share every key tile. Keys go in tiles of
// kW (a register's floats: 16 on AVX-512, 8 otherwise): the tile's keys are transposed once
// into [head_dim][kW] floats and its values widened into [kW][head_dim], then each query
// vector's kW scores are one register built by head_dim multiply-adds (a query element
// broadcast against the tile's keys' elements), with no lane sums; the softmax is online
// (running max and sum per query vector, the accumulator rescaled when the max grows); each
// value row is multiplied into several query vectors' accumulators at once (on AVX-512
// their whole rows; otherwise two registers of each at a time, so the accumulators fit
// sixteen registers). Everything is float32 whatever the tensors' dtype, as in the decode
// kernel. Work items are split among torch's threads in contiguous ranges of about equal
// key counts (later rows see more keys).
//
// The backend calls the kernel where it beat torch's SDPA (prefill_attention_fast: every
// prefill on AVX-512, prompts without cached context on AVX2); elsewhere it is correct but
// slower than SDPA.
//
// Layouts (checked at the boundary): q, out [L, H, head_dim]; k, v [S, KH, head_dim],
// S = context_len + L; any row and head strides, the last dimension contiguous; all float32
// or all bfloat16; H a multiple of KH; head_dim a multiple of 16 up to 256.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_vec_math.h"

namespace {

#if defined(__AVX512F__)
constexpr int kW = 16;  // floats per register
#else
constexpr int kW = 8;
#endif
typedef float vecw __attribute__((vector_size(kW * sizeof(float))));
typedef int32_t ivecw __attribute__((vector_size(kW * sizeof(int32_t))));
typedef uint16_t u16vecw __attribute__((vector_size(kW * sizeof(uint16_t))));
typedef uint32_t u32vecw __attribute__((vector_size(kW * sizeof(uint32_t))));

constexpr int kTile = kW;         // keys per tile: one vector of scores
constexpr int kQueryBlock = 16;   // query rows per work item
constexpr int kMaxHeadDim = 256;

inline vecw loadw(const float* p) {
  vecw v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void storew(float* p, vecw v) { std::memcpy(p, &v, sizeof v); }

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// kW consecutive elements as floats.
inline vecw widenw(const float* p) { return loadw(p); }
inline vecw widenw(const c10::BFloat16* p) {
  return pagectl_cpu::bf16_to_float<vecw, u16vecw, u32vecw>(p);
}

struct Shape {
  int64_t len, ctx, heads, kv_heads, dim;
  int64_t q_row, q_head, k_row, k_head, v_row, v_head, o_row, o_head;
  float scale;
};

// One work item: KV head h, query rows [r0, r1). NC = head_dim / kW; QG query vectors share
// each pass over a tile (their accumulators in registers), CB registers of each
// accumulator row at a time in the value pass.
template <typename T, int NC, int QG, int CB>
void attend_block(const Shape& s, const T* q, const T* k, const T* v, T* out, int64_t h,
                  int64_t r0, int64_t r1, std::vector<float>& scratch) {
  static_assert(NC % CB == 0);
  constexpr int D = NC * kW;
  const int64_t group = s.heads / s.kv_heads;
  const int64_t rows = r1 - r0;
  const int64_t nq = rows * group;  // query vector i: row r0 + i / group, head h*group + i % group
  const int64_t np = (nq + QG - 1) / QG * QG;  // padded to whole passes (zero queries)
  // Scratch: queries [np][D], accumulators [np][D], scores/weights [np][kW], K^T [D][kW],
  // V [kW][D], running sums [nq][kW] (lane-wise: summed once at the end), running max [nq].
  scratch.assign(
      static_cast<size_t>(np * D * 2 + np * kTile + D * kTile * 2 + nq * kTile + nq), 0.0f);
  float* qs = scratch.data();
  float* acc = qs + np * D;
  float* p = acc + np * D;
  float* kt = p + np * kTile;
  float* vt = kt + D * kTile;
  float* run_sum = vt + kTile * D;
  float* run_max = run_sum + nq * kTile;
  for (int64_t i = 0; i < nq; ++i) {
    const T* qi = q + (r0 + i / group) * s.q_row + (h * group + i % group) * s.q_head;
    for (int d = 0; d < D; ++d) qs[i * D + d] = to_float(qi[d]) * s.scale;
    run_max[i] = -std::numeric_limits<float>::infinity();
  }
  const int64_t key_end = s.ctx + r1;  // the last row sees keys < key_end
  for (int64_t k0 = 0; k0 < key_end; k0 += kTile) {
    const int64_t nk = std::min<int64_t>(kTile, key_end - k0);
    // Transpose the tile's keys, widen its values; missing keys are zero (and masked).
    for (int64_t j = 0; j < kTile; ++j) {
      if (j < nk) {
        const T* kr = k + (k0 + j) * s.k_row + h * s.k_head;
        const T* vr = v + (k0 + j) * s.v_row + h * s.v_head;
        for (int c = 0; c < NC; ++c) {
          const vecw kv = widenw(kr + kW * c);
          for (int e = 0; e < kW; ++e) kt[(kW * c + e) * kTile + j] = kv[e];
          storew(vt + j * D + kW * c, widenw(vr + kW * c));
        }
      } else {
        for (int d = 0; d < D; ++d) {
          kt[d * kTile + j] = 0.0f;
          vt[j * D + d] = 0.0f;
        }
      }
    }
    // Keys past a row's position are masked: only tiles reaching past s.ctx + r0 need it.
    const bool diagonal = k0 + kTile > s.ctx + r0;
    for (int64_t i0 = 0; i0 < nq; i0 += QG) {
      const int qn = static_cast<int>(std::min<int64_t>(QG, nq - i0));
      vecw sc[QG];
      for (int g = 0; g < QG; ++g) sc[g] = vecw{};
      for (int d = 0; d < D; ++d) {
        const vecw kd = loadw(kt + d * kTile);
        for (int g = 0; g < QG; ++g) sc[g] += qs[(i0 + g) * D + d] * kd;
      }
      for (int g = 0; g < qn; ++g) {
        const int64_t i = i0 + g;
        float* pi = p + i * kTile;
        storew(pi, sc[g]);
        // Keys past this row's position or past the tile's end: weight 0.
        int64_t visible = kTile;
        if (diagonal || nk < kTile) {
          visible = std::min<int64_t>(nk, s.ctx + r0 + i / group - k0 + 1);
          for (int64_t j = std::max<int64_t>(visible, 0); j < kTile; ++j)
            pi[j] = -std::numeric_limits<float>::infinity();
        }
        const vecw si = loadw(pi);
        // The first tile holds key 0, which every row sees: from then on m is finite.
        const float m = std::max(run_max[i], pagectl_cpu::lane_max(si));
        vecw e = pagectl_cpu::exp_nonpositive<vecw, ivecw>(si - m);
        e = si == -std::numeric_limits<float>::infinity() ? vecw{} : e;
        // The running max seldom grows after the first tiles: no exp then.
        const float alpha = m > run_max[i] ? std::exp(run_max[i] - m) : 1.0f;
        storew(run_sum + i * kTile, loadw(run_sum + i * kTile) * alpha + e);
        run_max[i] = m;
        storew(pi, e);
        if (alpha != 1.0f) {
          float* ai = acc + i * D;
          for (int c = 0; c < NC; ++c) storew(ai + kW * c, loadw(ai + kW * c) * alpha);
        }
      }
      // Values: QG accumulators of CB vectors each stay in registers over the tile.
      for (int c0 = 0; c0 < NC; c0 += CB) {
        vecw a[QG][CB];
        for (int g = 0; g < QG; ++g)
          for (int c = 0; c < CB; ++c) a[g][c] = loadw(acc + (i0 + g) * D + kW * (c0 + c));
        for (int64_t j = 0; j < nk; ++j) {
          for (int c = 0; c < CB; ++c) {
            const vecw vv = loadw(vt + j * D + kW * (c0 + c));
            for (int g = 0; g < QG; ++g) a[g][c] += p[(i0 + g) * kTile + j] * vv;
          }
        }
        for (int g = 0; g < qn; ++g)
          for (int c = 0; c < CB; ++c) storew(acc + (i0 + g) * D + kW * (c0 + c), a[g][c]);
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    T* oi = out + (r0 + i / group) * s.o_row + (h * group + i % group) * s.o_head;
    const float inv = 1.0f / pagectl_cpu::lane_sum(loadw(run_sum + i * kTile));
    for (int d = 0; d < D; ++d) oi[d] = static_cast<T>(acc[i * D + d] * inv);
  }
}

template <typename T, int NC16>
void attend_all(const Shape& s, const T* q, const T* k, const T* v, T* out) {
  constexpr int NC = NC16 * 16 / kW;
  // Query vectors per pass, and accumulator registers of each in the value pass: with 32
  // AVX-512 registers, whole rows of up to 4 registers for 4 queries; with 16, 2 x 4.
  constexpr int QG = kW == 8 || NC <= 4 ? 4 : 2;
  constexpr int CB = kW == 8 ? 2 : NC;
  const int64_t blocks = (s.len + kQueryBlock - 1) / kQueryBlock;
  const int64_t items = blocks * s.kv_heads;  // item: block-major, then KV head
  auto keys_of = [&](int64_t item) {
    const int64_t b = item / s.kv_heads;
    return s.ctx + std::min<int64_t>(s.len, (b + 1) * kQueryBlock);
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  // Contiguous chunks of items with about equal key counts.
  int64_t total = 0;
  for (int64_t it = 0; it < items; ++it) total += keys_of(it);
  std::vector<int64_t> bounds(threads + 1, items);
  bounds[0] = 0;
  int64_t done = 0, chunk = 1;
  for (int64_t it = 0; it < items && chunk < threads; ++it) {
    done += keys_of(it);
    while (chunk < threads && done * threads >= chunk * total) bounds[chunk++] = it + 1;
  }
  at::parallel_for(0, threads, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> scratch;
    for (int64_t c = c0; c < c1; ++c) {
      for (int64_t it = bounds[c]; it < bounds[c + 1]; ++it) {
        const int64_t b = it / s.kv_heads, h = it % s.kv_heads;
        const int64_t r0 = b * kQueryBlock, r1 = std::min<int64_t>(s.len, r0 + kQueryBlock);
        attend_block<T, NC, QG, CB>(s, q, k, v, out, h, r0, r1, scratch);
      }
    }
  });
}

template <typename T>
void dispatch(const Shape& s, const T* q, const T* k, const T* v, T* out) {
  switch (s.dim / 16) {
    case 1: attend_all<T, 1>(s, q, k, v, out); break;
    case 2: attend_all<T, 2>(s, q, k, v, out); break;
    case 3: attend_all<T, 3>(s, q, k, v, out); break;
    case 4: attend_all<T, 4>(s, q, k, v, out); break;
    case 5: attend_all<T, 5>(s, q, k, v, out); break;
    case 6: attend_all<T, 6>(s, q, k, v, out); break;
    case 7: attend_all<T, 7>(s, q, k, v, out); break;
    case 8: attend_all<T, 8>(s, q, k, v, out); break;
    case 12: attend_all<T, 12>(s, q, k, v, out); break;
    case 16: attend_all<T, 16>(s, q, k, v, out); break;
    default: TORCH_CHECK(false, "prefill_attention: head_dim ", s.dim, " is not supported");
  }
}

bool supported_head_dim(int64_t d) {
  if (d % 16 != 0 || d <= 0 || d > kMaxHeadDim) return false;
  const int64_t n = d / 16;
  return n <= 8 || n == 12 || n == 16;
}

void prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       int64_t context_len, double scale, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3,
              "prefill_attention: q, k, v and out must be 3-D");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16,
              "prefill_attention: float32 or bfloat16 only");
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt && out.scalar_type() == dt,
              "prefill_attention: q, k, v and out must share a dtype");
  const int64_t len = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t keys = k.size(0), kv_heads = k.size(1);
  TORCH_CHECK(context_len >= 0 && keys == context_len + len,
              "prefill_attention: k holds ", keys, " keys, expected context_len + rows = ",
              context_len + len);
  TORCH_CHECK(v.size(0) == keys && v.size(1) == kv_heads && k.size(2) == dim &&
                  v.size(2) == dim,
              "prefill_attention: k and v must be [S, KH, head_dim] alike");
  TORCH_CHECK(out.size(0) == len && out.size(1) == heads && out.size(2) == dim,
              "prefill_attention: out must be shaped like q");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0,
              "prefill_attention: heads must be a multiple of KV heads");
  TORCH_CHECK(supported_head_dim(dim), "prefill_attention: head_dim ", dim,
              " is not supported (multiples of 16 up to 128, 192 or 256)");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1,
              "prefill_attention: the last dimension must be contiguous");
  if (len == 0) return;
  const Shape s{len,         context_len, heads,       kv_heads,    dim,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                v.stride(1), out.stride(0), out.stride(1), static_cast<float>(scale)};
  if (dt == at::kFloat) {
    dispatch(s, q.const_data_ptr<float>(), k.const_data_ptr<float>(), v.const_data_ptr<float>(),
             out.mutable_data_ptr<float>());
  } else {
    dispatch(s, q.const_data_ptr<c10::BFloat16>(), k.const_data_ptr<c10::BFloat16>(),
             v.const_data_ptr<c10::BFloat16>(), out.mutable_data_ptr<c10::BFloat16>());
  }
}

// Which prefills the kernel beats torch's SDPA on in this build (benchmarks/
// prefill_attention.py): 2 every prefill (AVX-512), 1 prompts without cached context only
// (AVX2: its 8-key tiles' bookkeeping loses to SDPA's GEMMs over long cached contexts),
// 0 none (no vector instructions it was tuned for).
int64_t prefill_attention_fast() {
#if defined(__AVX512F__)
  return 2;
#elif defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagectl_cpu, m) {
  m.def(
      "prefill_attention(Tensor q, Tensor k, Tensor v, int context_len, float scale, "
      "Tensor(a!) out) -> ()");
  m.def("prefill_attention_fast() -> int", &prefill_attention_fast);
}

TORCH_LIBRARY_IMPL(pagectl_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
