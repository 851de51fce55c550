// y = x W^T (* scale) (+ bias) for the rows of a decode step (up to a prefill's): the
// project's CPU matmul over a plain [N, K] weight.
//
// Registered as torch.ops.pagectl_cpu.skinny_linear; built with the attention kernel by
// pagectl/engine/attention/cpu_build.py, called by pagectl/engine/models/linear.py.
//
// Weights stay in the checkpoint's own [N, K] layout (no packed copy) and may be float32,
// bfloat16 (widened to float32 in registers: half the bytes of float32) or int8 with one
// float32 scale per output row (a quarter). Arithmetic is float32 throughout, whatever the
// weight and x dtypes. Vector code is GCC/Clang vector extensions on 8 floats (one AVX2
// register, two SSE or NEON ones), with AVX2 intrinsics for loads the compiler would not
// find by itself.
//
// Two shapes of work, by the number of rows M of x:
// - Few rows (M < kBcastMinRows): the time is the time to stream the weights from memory.
//   Output features are split among torch's intra-op threads in tiles of kTileN rows; a
//   tile's weight rows are multiplied by up to kTileM rows of x at once (dot products:
//   kTileN x kTileM accumulators of 8 floats, summed across lanes at the end), the next
//   tile prefetched as this one is read.
// - More rows: the arithmetic bounds the time; see run_bcast (each weight element
//   broadcast against a register of 8 rows of x, x re-laid once per call).
//
// Layouts (checked at the boundary):
//   x      [M, K] float32 or bfloat16 (copied if not contiguous); K a multiple of 8
//   weight [N, K] float32, bfloat16 or int8, contiguous; or a weight packed by pack_weight
//          (packed_linear_cpu.cpp: bfloat16 [N / 64, K / 2, 64, 2] on CPUs with AVX512-BF16,
//          float32 [N / 64, K, 64] with AVX-512), for x of the same dtype
//   scale  [N] float32, required for int8 (and allowed for the others)
//   bias   [N] any floating dtype, optional
//   out    [M, N] in x's dtype

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_vec_math.h"

namespace {

typedef float fvec8 __attribute__((vector_size(8 * sizeof(float))));
typedef uint16_t u16vec8 __attribute__((vector_size(8 * sizeof(uint16_t))));
typedef uint32_t u32vec8 __attribute__((vector_size(8 * sizeof(uint32_t))));
typedef int8_t i8vec8 __attribute__((vector_size(8 * sizeof(int8_t))));

constexpr int kTileN = 4;  // weight rows per tile
constexpr int kTileM = 3;  // rows of x per pass over a tile

inline fvec8 load8(const float* p) {
  fvec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline fvec8 load8(const c10::BFloat16* p) {
  // bfloat16 is the top half of a float32: widen and shift.
#if defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<fvec8>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  return pagectl_cpu::bf16_to_float<fvec8, u16vec8, u32vec8>(p);
#endif
}

inline fvec8 load8(const int8_t* p) {
#if defined(__AVX2__)
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<fvec8>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
#else
  i8vec8 q;
  std::memcpy(&q, p, sizeof q);
  return __builtin_convertvector(q, fvec8);
#endif
}

inline float hsum(fvec8 v) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// out[m, n + r] for r < NR, m < MR: rows n.. of w times rows 0.. of x. ``next`` (or null):
// the next tile's rows, prefetched a cache line at a time as this tile's are read. Rows of
// a bfloat16 or int8 weight are short (1 KiB for 1024 int8 features), too short for the
// hardware prefetcher to ramp up on each: without this, int8 stayed far below the memory
// bandwidth that float32 reached.
template <typename W, int NR, int MR>
inline void tile(const float* x, const W* w, int64_t k_dim, float* acc_out, const W* next) {
  fvec8 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = fvec8{};
  for (int64_t k = 0; k < k_dim; k += 8) {
    if (next != nullptr && ((k * sizeof(W)) & 63) == 0) {
      for (int r = 0; r < NR; ++r) __builtin_prefetch(next + r * k_dim + k, 0, 3);
    }
    fvec8 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = load8(x + m * k_dim + k);
    for (int r = 0; r < NR; ++r) {
      const fvec8 wv = load8(w + r * k_dim + k);
      for (int m = 0; m < MR; ++m) acc[r][m] += wv * xv[m];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc_out[m * NR + r] = hsum(acc[r][m]);
}

template <typename W, int NR>
inline void tile_rows(const float* x, int64_t m_dim, const W* w, int64_t k_dim, float* acc,
                      const W* next) {
  // acc: [m_dim, NR]; the first pass over the tile prefetches the next one.
  int64_t m = 0;
  for (; m + kTileM <= m_dim; m += kTileM)
    tile<W, NR, kTileM>(x + m * k_dim, w, k_dim, acc + m * NR, m == 0 ? next : nullptr);
  switch (m_dim - m) {
    case 2:
      tile<W, NR, 2>(x + m * k_dim, w, k_dim, acc + m * NR, m == 0 ? next : nullptr);
      break;
    case 1:
      tile<W, NR, 1>(x + m * k_dim, w, k_dim, acc + m * NR, m == 0 ? next : nullptr);
      break;
    default:
      break;
  }
}

template <int TN, typename W, typename O>
void run_tiles(const float* x, int64_t m_dim, int64_t k_dim, const W* w, int64_t n_dim,
         const float* scale, const float* bias, O* out) {
  const int64_t tiles = (n_dim + TN - 1) / TN;
  // Enough tiles per thread that a task reads a few KiB of weights at least.
  const int64_t grain = std::max<int64_t>(1, 4096 / (k_dim * TN));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(m_dim) * TN);
    constexpr bool kNarrow = !std::is_same_v<W, float>;
    const bool widen = kNarrow && m_dim > kTileM;
    std::vector<float> wide(widen ? static_cast<size_t>(TN * k_dim) : 0);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * TN;
      const int64_t nr = std::min<int64_t>(TN, n_dim - n0);
      const W* wt = w + n0 * k_dim;
      // The next full tile of this task, if any.
      const W* next = t + 1 < end && n0 + 2 * TN <= n_dim ? wt + TN * k_dim : nullptr;
      if (nr == TN && widen) {
        // Many rows: widen the tile to float32 once, so the rows of x that follow the first
        // kTileM reuse it instead of converting it again.
        for (int64_t i = 0; i < TN * k_dim; i += 8) {
          const fvec8 v = load8(wt + i);
          std::memcpy(wide.data() + i, &v, sizeof v);
        }
        tile_rows<float, TN>(x, m_dim, wide.data(), k_dim, acc.data(), nullptr);
      } else if (nr == TN) {
        tile_rows<W, TN>(x, m_dim, wt, k_dim, acc.data(), next);
      } else {
        for (int64_t r = 0; r < nr; ++r)
          tile_rows<W, 1>(x, m_dim, wt + r * k_dim, k_dim, acc.data() + r * m_dim, nullptr);
      }
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t n = n0 + r;
        const float s = scale ? scale[n] : 1.0f;
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m = 0; m < m_dim; ++m) {
          // Full tiles store [m, r]; the row-at-a-time tail stores [r, m].
          const float v = nr == TN ? acc[m * TN + r] : acc[r * m_dim + m];
          out[m * n_dim + n] = static_cast<O>(v * s + b);
        }
      }
    }
  });
}

// From kBcastMinRows rows of x on, the arithmetic (not the weight stream) bounds the time,
// and the kernel switches shape. x is copied once per call into blocks of 16 rows (8 for
// the last block when M is not a multiple of 16), each block stored k-major ([K, 16]:
// the 16 rows' k-th features side by side), zero-padded to a multiple of 8 rows. A tile
// of kBcastN weight rows multiplies a block at a time: each weight element is broadcast
// and multiplies one register of 8 rows of x, so the accumulators (kBcastN x 2 registers)
// hold whole output columns and need no horizontal sums. The input features are taken in
// chunks short enough that every block's chunk of x stays in L2 while a group of tiles
// streams past it; partial sums wait in a small per-thread buffer between chunks.
// Narrow weights (bf16, int8) are widened a tile chunk at a time, once for all blocks.
constexpr int kBcastN = 6;      // weight rows per tile
constexpr int kBlockM = 16;     // rows of x per block (two registers)
constexpr int kGroupTiles = 8;  // tiles that share a chunk of x before the next chunk
constexpr int64_t kBcastMinRows = 16;
constexpr int64_t kChunkBytes = 192 * 1024;  // x's share of L2 per chunk

inline void store8(float* p, fvec8 v) { std::memcpy(p, &v, sizeof v); }

inline fvec8 broadcast8(const float* p) {
#if defined(__AVX2__)
  return reinterpret_cast<fvec8>(_mm256_broadcast_ss(p));
#else
  return fvec8{} + *p;
#endif
}

// acc[r][v] (+)= sum over k < k_len of w[r * ldw + k] * xb[k * MV * 8 + 8 * v ..].
template <int MV>
inline void bcast_block(const float* __restrict xb, const float* __restrict w, int64_t ldw,
                        int64_t k_len, bool first, float* __restrict acc_io) {
  // Local accumulators: kept in registers (through a pointer the compiler would assume the
  // loads may alias them).
  fvec8 acc[kBcastN][MV] = {};
  if (!first) {
    for (int r = 0; r < kBcastN; ++r)
      for (int v = 0; v < MV; ++v) acc[r][v] = load8(acc_io + (r * MV + v) * 8);
  }
  for (int64_t k = 0; k < k_len; ++k) {
    fvec8 xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = load8(xb + k * MV * 8 + 8 * v);
    for (int r = 0; r < kBcastN; ++r) {
      const fvec8 b = broadcast8(w + r * ldw + k);
      for (int v = 0; v < MV; ++v) acc[r][v] += b * xv[v];
    }
  }
  for (int r = 0; r < kBcastN; ++r)
    for (int v = 0; v < MV; ++v) store8(acc_io + (r * MV + v) * 8, acc[r][v]);
}

template <typename W, typename O>
void run_bcast(const float* x, int64_t m_dim, int64_t k_dim, const W* w, int64_t n_dim,
               const float* scale, const float* bias, O* out) {
  const int64_t mp = (m_dim + 7) / 8 * 8;
  const int64_t blocks = (mp + kBlockM - 1) / kBlockM;
  auto block_width = [&](int64_t b) { return std::min<int64_t>(kBlockM, mp - b * kBlockM); };
  // Block b holds rows b*16.. as [K, width]; rows past M are zero. Every element is written
  // below, so the buffer is not zero-filled first.
  std::unique_ptr<float[]> xb(new float[static_cast<size_t>(mp * k_dim)]);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t m0 = b * kBlockM, wb = block_width(b);
      float* dst = xb.get() + m0 * k_dim;
      for (int64_t i = 0; i < wb; ++i) {
        const int64_t m = m0 + i;
        if (m < m_dim) {
          const float* src = x + m * k_dim;
          for (int64_t k = 0; k < k_dim; ++k) dst[k * wb + i] = src[k];
        } else {
          for (int64_t k = 0; k < k_dim; ++k) dst[k * wb + i] = 0.0f;
        }
      }
    }
  });
  int64_t kc = kChunkBytes / static_cast<int64_t>(sizeof(float) * mp);
  kc = std::min<int64_t>(k_dim, std::max<int64_t>(64, kc / 8 * 8));
  const int64_t tiles = (n_dim + kBcastN - 1) / kBcastN;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    constexpr bool kNarrow = !std::is_same_v<W, float>;
    std::vector<float> wide(static_cast<size_t>(kBcastN * kc), 0.0f);
    // Partial sums of a group: [tile][block][kBcastN][16].
    std::vector<float> part(static_cast<size_t>(kGroupTiles * blocks * kBcastN * kBlockM));
    for (int64_t g0 = begin; g0 < end; g0 += kGroupTiles) {
      const int64_t g1 = std::min<int64_t>(end, g0 + kGroupTiles);
      for (int64_t k0 = 0; k0 < k_dim; k0 += kc) {
        const int64_t k_len = std::min<int64_t>(kc, k_dim - k0);
        const bool first = k0 == 0, last = k0 + k_len == k_dim;
        for (int64_t t = g0; t < g1; ++t) {
          const int64_t n0 = t * kBcastN;
          const int64_t nr = std::min<int64_t>(kBcastN, n_dim - n0);
          const float* wt;
          int64_t ldw;
          if (!kNarrow && nr == kBcastN) {
            wt = reinterpret_cast<const float*>(w) + n0 * k_dim + k0;
            ldw = k_dim;
          } else {
            for (int64_t r = 0; r < kBcastN; ++r) {
              float* d = wide.data() + r * k_len;
              if (r >= nr) {
                std::fill(d, d + k_len, 0.0f);
                continue;
              }
              const W* s = w + (n0 + r) * k_dim + k0;
              for (int64_t i = 0; i < k_len; i += 8) {
                const fvec8 v = load8(s + i);
                std::memcpy(d + i, &v, sizeof v);
              }
            }
            wt = wide.data();
            ldw = k_len;
          }
          for (int64_t b = 0; b < blocks; ++b) {
            const int64_t m0 = b * kBlockM, wb = block_width(b);
            float* acc = part.data() + ((t - g0) * blocks + b) * kBcastN * kBlockM;
            const float* xc = xb.get() + m0 * k_dim + k0 * wb;
            if (wb == kBlockM) {
              bcast_block<2>(xc, wt, ldw, k_len, first, acc);
            } else {
              bcast_block<1>(xc, wt, ldw, k_len, first, acc);
            }
            if (!last) continue;
            const int mv = static_cast<int>(wb / 8);
            for (int64_t r = 0; r < nr; ++r) {
              const int64_t n = n0 + r;
              const float s = scale ? scale[n] : 1.0f;
              const float bb = bias ? bias[n] : 0.0f;
              for (int64_t i = 0; i < wb && m0 + i < m_dim; ++i)
                out[(m0 + i) * n_dim + n] = static_cast<O>(acc[r * mv * 8 + i] * s + bb);
            }
          }
        }
      }
    }
  });
}

template <typename W, typename O>
void run(const float* x, int64_t m_dim, int64_t k_dim, const W* w, int64_t n_dim,
         const float* scale, const float* bias, O* out) {
  // One row of x: twice the weight rows per tile, so eight independent accumulators (and
  // eight weight streams) hide the latency of each FMA chain.
  if (m_dim >= kBcastMinRows) {
    run_bcast(x, m_dim, k_dim, w, n_dim, scale, bias, out);
  } else if (m_dim == 1) {
    run_tiles<2 * kTileN>(x, m_dim, k_dim, w, n_dim, scale, bias, out);
  } else {
    run_tiles<kTileN>(x, m_dim, k_dim, w, n_dim, scale, bias, out);
  }
}

}  // namespace

namespace pagectl_cpu {

void skinny_linear_out(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& scale,
                       const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() >= 2 && weight.dim() <= 4,
              "skinny_linear: x must be 2-D, weight 2-D (or 3-D/4-D when packed)");
  TORCH_CHECK(weight.is_contiguous(), "skinny_linear: weight must be contiguous");
  if (weight.dim() > 2) {
    const int64_t n = weight.size(0) * weight.size(2);
    at::Tensor scale_f, bias_f;
    if (scale.has_value() && scale->defined()) {
      scale_f = scale->to(at::kFloat).contiguous();
      TORCH_CHECK(scale_f.numel() == n, "skinny_linear: scale must have N entries");
    }
    if (bias.has_value() && bias->defined()) {
      bias_f = bias->to(at::kFloat).contiguous();
      TORCH_CHECK(bias_f.numel() == n, "skinny_linear: bias must have N entries");
    }
    packed_linear_out(x, weight, scale_f.defined() ? scale_f.data_ptr<float>() : nullptr,
                           bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, out);
    return;
  }
  const int64_t m_dim = x.size(0), k_dim = x.size(1), n_dim = weight.size(0);
  TORCH_CHECK(weight.size(1) == k_dim, "skinny_linear: weight is [", n_dim, ", ",
              weight.size(1), "], x has ", k_dim, " features");
  TORCH_CHECK(k_dim % 8 == 0, "skinny_linear: K must be a multiple of 8, got ", k_dim);
  const auto xt = x.scalar_type(), wt = weight.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16,
              "skinny_linear: x must be float32 or bfloat16");
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kChar,
              "skinny_linear: weight must be float32, bfloat16 or int8");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m_dim && out.size(1) == n_dim &&
                  out.is_contiguous() && out.scalar_type() == xt,
              "skinny_linear: out must be [M, N] contiguous in x's dtype");
  const float* scale_p = nullptr;
  at::Tensor scale_f;
  if (scale.has_value() && scale->defined()) {
    scale_f = scale->to(at::kFloat).contiguous();
    TORCH_CHECK(scale_f.numel() == n_dim, "skinny_linear: scale must have N entries");
    scale_p = scale_f.data_ptr<float>();
  }
  TORCH_CHECK(wt != at::kChar || scale_p, "skinny_linear: an int8 weight needs its scale");
  const float* bias_p = nullptr;
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f.numel() == n_dim, "skinny_linear: bias must have N entries");
    bias_p = bias_f.data_ptr<float>();
  }
  if (m_dim == 0 || n_dim == 0) return;
  const at::Tensor xf = xt == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  auto dispatch = [&](auto* out_p) {
    if (wt == at::kFloat) {
      run(xp, m_dim, k_dim, weight.data_ptr<float>(), n_dim, scale_p, bias_p, out_p);
    } else if (wt == at::kBFloat16) {
      run(xp, m_dim, k_dim, weight.data_ptr<c10::BFloat16>(), n_dim, scale_p, bias_p, out_p);
    } else {
      run(xp, m_dim, k_dim, weight.data_ptr<int8_t>(), n_dim, scale_p, bias_p, out_p);
    }
  };
  if (xt == at::kFloat) {
    dispatch(out.data_ptr<float>());
  } else {
    dispatch(out.data_ptr<c10::BFloat16>());
  }
}

}  // namespace pagectl_cpu

namespace {

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& scale,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() >= 2 && weight.dim() <= 4,
              "skinny_linear: x must be 2-D, weight 2-D (or 3-D/4-D when packed)");
  // A packed weight ([N / 64, K / 2, 64, 2] or [N / 64, K, 64]) has size(0) * 64 outputs.
  const int64_t n = weight.dim() > 2 ? weight.size(0) * weight.size(2) : weight.size(0);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  pagectl_cpu::skinny_linear_out(x, weight, scale, bias, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagectl_cpu, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? scale, Tensor? bias) -> Tensor");
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def("packed_linear_available(ScalarType dtype) -> bool",
        &pagectl_cpu::packed_linear_available);
}

TORCH_LIBRARY_IMPL(pagectl_cpu, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("pack_weight", &pagectl_cpu::pack_weight);
}
