// y = x W^T (* scale) (+ bias) over a weight packed for AVX-512: bfloat16 (by AVX512-BF16
// dot products, vdpbf16ps), float32 (by FMA) or int8 with one scale per output feature
// (widened to float32 in registers, by FMA), every row count, one kernel. Called by
// skinny_linear_out (skinny_linear_cpu.cpp) when the weight is 3-D or 4-D; packed by
// pack_weight below, which linear.py calls once after loading (the plain [N, K] weight is
// then freed).
//
// Packed layouts: bfloat16 [N / 64, K / 2, 64, 2], float32 and int8 [N / 64, K, 64]. Tile
// t holds output features 64t .. 64t + 63. For each step of the input features (a pair
// (2p, 2p + 1) in bfloat16, one feature otherwise) it stores the 64 features' weights side
// by side, so four register loads (an int8 load widened) give one register per 16 output
// features, and one broadcast of x's step multiplies all four: each float32 lane gains
// w[n, k] x[k] (summed over the pair in bfloat16) for its own output feature n. No lane
// sums at the end, and a thread reads its tiles' weights as one contiguous stream (the
// plain kernel read 4-8 rows at once, each slower than the hardware prefetcher keeps up
// with: 21-25 GB/s at one row where this reads 30-43 on the same machine;
// docs/PERFORMANCE.md, section 12).
//
// A tile multiplies up to kRows rows of x at a time (kRows x 4 accumulators); more rows
// re-read the tile from L2 (K x 128 bytes in bfloat16, 256 in float32, 64 in int8). Rows are
// taken in blocks small enough to stay in L2 while a thread's tiles stream past. One row
// keeps two sets of accumulators (even and odd steps) so eight chains hide the instructions' latency.
//
// Arithmetic: float32 sums. bfloat16 products are exact in float32, so the bfloat16 result is
// a float32 sum of the exact products (denormals flushed, as vdpbf16ps does), scaled,
// biased and rounded to bfloat16 once (to nearest even); float32 and int8 round each
// product-add once (FMA; int8 values are exact in float32), the int8 scale applied to the
// sum. Only the order of the sums differs from the plain kernels'.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"

namespace {

constexpr int64_t kTileCols = 64;

#if defined(__AVX512F__)

constexpr int kRows = 6;  // rows of x per pass over a tile: 24 accumulators

// What differs between the element types: features per step, the broadcast of x's step,
// the multiply-add, and how an output vector is stored.
struct F32 {
  using T = float;  // weight element
  using X = float;  // activation element
  using W = __m512;
  static constexpr int kStep = 1;
  static W load(const T* p) { return _mm512_loadu_ps(p); }
  static W bcast(const T* x) { return _mm512_set1_ps(*x); }
  static __m512 mac(__m512 acc, W w, W x) { return _mm512_fmadd_ps(w, x, acc); }
};

// int8 weights, widened to float32 16 at a time (the scale is applied at the end, per output
// feature); float32 x.
struct I8 {
  using T = int8_t;
  using X = float;
  using W = __m512;
  static constexpr int kStep = 1;
  static W load(const T* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static W bcast(const X* x) { return _mm512_set1_ps(*x); }
  static __m512 mac(__m512 acc, W w, W x) { return _mm512_fmadd_ps(w, x, acc); }
};

#if defined(__AVX512BF16__)
struct BF16 {
  using T = c10::BFloat16;
  using X = c10::BFloat16;
  using W = __m512bh;
  static constexpr int kStep = 2;
  static W load(const T* p) { return reinterpret_cast<W>(_mm512_loadu_si512(p)); }
  static W bcast(const X* x) {
    int32_t v;
    std::memcpy(&v, x, sizeof v);
    return reinterpret_cast<W>(_mm512_set1_epi32(v));
  }
  static __m512 mac(__m512 acc, W w, W x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#endif

inline void store_out(__m512 v, float* o) { _mm512_storeu_ps(o, v); }
#if defined(__AVX512BF16__)
inline void store_out(__m512 v, c10::BFloat16* o) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
#else
inline void store_out(__m512 v, c10::BFloat16* o) {
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int i = 0; i < 16; ++i) o[i] = c10::BFloat16(tmp[i]);
}
#endif

// Stores 16 lanes of an output row at feature n, scaled and biased.
template <typename O>
inline void store16(__m512 v, O* o, const float* scale, const float* bias, int64_t n) {
  if (scale) v = _mm512_mul_ps(v, _mm512_loadu_ps(scale + n));
  if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
  store_out(v, o + n);
}

// The lines of the next tile that one pass over a tile prefetches into L2 (its share).
struct NextTile {
  const char* start = nullptr;  // the share's first byte; nullptr: nothing to prefetch
  int64_t lines = 0;            // 64-byte lines in the share
};

// MR rows of x (``ldx`` apart) times one tile (``steps`` steps), into out rows (``ldo``
// apart) at feature n0. ``next``'s lines are prefetched into L2 spread evenly over the steps.
template <typename E, typename O, int MR>
inline void tile_rows(const typename E::X* x, int64_t ldx, const typename E::T* wt,
                      int64_t steps, O* out, int64_t ldo, int64_t n0, const float* scale,
                      const float* bias, NextTile next = {}) {
  constexpr int64_t kStepElems = E::kStep * kTileCols;
  constexpr int kVec = 16 * E::kStep;  // weight elements per register
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t line = 0;  // next's lines prefetched so far
  for (int64_t p = 0; p < steps; ++p) {
    // Line (p + 1) * lines / steps - 1 is due by the end of step p.
    for (; next.start != nullptr && line * steps < (p + 1) * next.lines; ++line) {
      __builtin_prefetch(next.start + 64 * line, 0, 2);
    }
    const typename E::T* w = wt + p * kStepElems;
    const typename E::W w0 = E::load(w), w1 = E::load(w + kVec), w2 = E::load(w + 2 * kVec),
                        w3 = E::load(w + 3 * kVec);
    for (int m = 0; m < MR; ++m) {
      const typename E::W xb = E::bcast(x + m * ldx + E::kStep * p);
      acc[m][0] = E::mac(acc[m][0], w0, xb);
      acc[m][1] = E::mac(acc[m][1], w1, xb);
      acc[m][2] = E::mac(acc[m][2], w2, xb);
      acc[m][3] = E::mac(acc[m][3], w3, xb);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) store16(acc[m][j], out + m * ldo, scale, bias, n0 + 16 * j);
}

// One row: even and odd steps in separate accumulators (eight independent chains).
template <typename E, typename O>
inline void tile_one_row(const typename E::X* x, const typename E::T* wt, int64_t steps,
                         O* out, int64_t n0, const float* scale, const float* bias) {
  constexpr int64_t kStepElems = E::kStep * kTileCols;
  constexpr int kVec = 16 * E::kStep;
  __m512 a[2][4];
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j) a[h][j] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + 2 <= steps; p += 2) {
    for (int h = 0; h < 2; ++h) {
      const typename E::T* w = wt + (p + h) * kStepElems;
      const typename E::W xb = E::bcast(x + E::kStep * (p + h));
      for (int j = 0; j < 4; ++j) a[h][j] = E::mac(a[h][j], E::load(w + kVec * j), xb);
    }
  }
  if (p < steps) {
    const typename E::T* w = wt + p * kStepElems;
    const typename E::W xb = E::bcast(x + E::kStep * p);
    for (int j = 0; j < 4; ++j) a[0][j] = E::mac(a[0][j], E::load(w + kVec * j), xb);
  }
  for (int j = 0; j < 4; ++j)
    store16(_mm512_add_ps(a[0][j], a[1][j]), out, scale, bias, n0 + 16 * j);
}

template <typename E, typename O>
void run_packed(const typename E::X* x, int64_t m_dim, int64_t k_dim, const typename E::T* wp,
                int64_t n_dim, const float* scale, const float* bias, O* out) {
  using T = typename E::T;
  using X = typename E::X;
  const int64_t tiles = n_dim / kTileCols, steps = k_dim / E::kStep;
  const int64_t tile_elems = k_dim * kTileCols;
  const int64_t tile_bytes = tile_elems * static_cast<int64_t>(sizeof(T));
  // Rows of x taken together through a thread's tiles: bounded so they stay in L2 while
  // the tiles stream past (192 KiB: 96 rows of 1024 bfloat16 features).
  const int64_t row_bytes = k_dim * static_cast<int64_t>(sizeof(X));
  const int64_t row_block = std::max<int64_t>(kRows, (196608 / row_bytes) / kRows * kRows);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m_dim; r0 += row_block) {
      const int64_t r1 = std::min<int64_t>(m_dim, r0 + row_block);
      for (int64_t t = begin; t < end; ++t) {
        const T* wt = wp + t * tile_elems;
        const int64_t n0 = t * kTileCols;
        if (m_dim == 1) {
          tile_one_row<E>(x, wt, steps, out, n0, scale, bias);
          continue;
        }
        // Several passes over a tile read it from L2 after the first, which alone would
        // stream it from memory (at the compute speed of kRows rows, while the other passes
        // leave the memory idle): each pass prefetches its share of the next tile instead,
        // so the whole tile time overlaps the next tile's fetch (after a thread's last tile,
        // the next is its first, for the next row block). 16-32 rows of the 33.6M model's
        // bfloat16 matmuls: 1.02-1.09x (medians of 6 alternated rounds, two runs).
        const int64_t passes = (r1 - r0 + kRows - 1) / kRows;
        const NextTile next_tile{
            reinterpret_cast<const char*>(t + 1 < end ? wt + tile_elems : wp + begin * tile_elems),
            tile_bytes / 64};
        const bool has_next = passes > 1 && (t + 1 < end || r1 < m_dim);
        const int64_t share = (next_tile.lines + passes - 1) / passes;
        auto next_share = [&](int64_t pass) {
          if (!has_next) return NextTile{};
          const int64_t first = std::min(pass * share, next_tile.lines);
          return NextTile{next_tile.start + 64 * first,
                          std::min(share, next_tile.lines - first)};
        };
        int64_t m = r0;
        int64_t pass = 0;
        for (; m + kRows <= r1; m += kRows, ++pass)
          tile_rows<E, O, kRows>(x + m * k_dim, k_dim, wt, steps, out + m * n_dim, n_dim, n0,
                                 scale, bias, next_share(pass));
        const X* xm = x + m * k_dim;
        O* om = out + m * n_dim;
        const NextTile last = next_share(pass);
        switch (r1 - m) {
          case 5: tile_rows<E, O, 5>(xm, k_dim, wt, steps, om, n_dim, n0, scale, bias, last); break;
          case 4: tile_rows<E, O, 4>(xm, k_dim, wt, steps, om, n_dim, n0, scale, bias, last); break;
          case 3: tile_rows<E, O, 3>(xm, k_dim, wt, steps, om, n_dim, n0, scale, bias, last); break;
          case 2: tile_rows<E, O, 2>(xm, k_dim, wt, steps, om, n_dim, n0, scale, bias, last); break;
          case 1: tile_rows<E, O, 1>(xm, k_dim, wt, steps, om, n_dim, n0, scale, bias, last); break;
          default: break;
        }
      }
    }
  });
}

#endif  // __AVX512F__

// Packs [N, steps] units U (a unit: one step's elements) into [N / 64, steps, 64]: tile t,
// step p, column c holds unit p of row 64t + c.
template <typename U>
void pack_steps(const U* src, U* dst, int64_t n_dim, int64_t steps) {
  at::parallel_for(0, n_dim / kTileCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t c = 0; c < kTileCols; ++c) {
        const U* row = src + (t * kTileCols + c) * steps;
        U* col = dst + t * steps * kTileCols + c;
        for (int64_t p = 0; p < steps; ++p) col[p * kTileCols] = row[p];
      }
  });
}

}  // namespace

namespace pagectl_cpu {

bool packed_linear_available(at::ScalarType dtype) {
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
#if defined(__AVX512F__)
  if (dtype == at::kFloat || dtype == at::kChar) return true;
#endif
  return false;
}

at::Tensor pack_weight(const at::Tensor& weight) {
  const auto dt = weight.scalar_type();
  TORCH_CHECK(weight.dim() == 2 && (dt == at::kBFloat16 || dt == at::kFloat || dt == at::kChar),
              "pack_weight: weight must be a 2-D bfloat16, float32 or int8 tensor");
  const int64_t n_dim = weight.size(0), k_dim = weight.size(1);
  TORCH_CHECK(n_dim % kTileCols == 0 && k_dim % 8 == 0 && n_dim > 0 && k_dim > 0,
              "pack_weight: [N, K] needs N a multiple of 64 and K of 8, got [", n_dim, ", ",
              k_dim, "]");
  const at::Tensor w = weight.contiguous();
  if (dt == at::kBFloat16) {
    // A pair of bfloat16 moves as one 32-bit word.
    at::Tensor packed = at::empty({n_dim / kTileCols, k_dim / 2, kTileCols, 2}, w.options());
    pack_steps(reinterpret_cast<const uint32_t*>(w.const_data_ptr()),
               reinterpret_cast<uint32_t*>(packed.mutable_data_ptr()), n_dim, k_dim / 2);
    return packed;
  }
  at::Tensor packed = at::empty({n_dim / kTileCols, k_dim, kTileCols}, w.options());
  if (dt == at::kFloat) {
    pack_steps(w.const_data_ptr<float>(), packed.mutable_data_ptr<float>(), n_dim, k_dim);
  } else {
    pack_steps(w.const_data_ptr<int8_t>(), packed.mutable_data_ptr<int8_t>(), n_dim, k_dim);
  }
  return packed;
}

void packed_linear_out(const at::Tensor& x, const at::Tensor& packed, const float* scale,
                       const float* bias, const at::Tensor& out) {
  const auto dt = packed.scalar_type();
  const bool bf16 = dt == at::kBFloat16 && packed.dim() == 4 && packed.size(3) == 2;
  const bool f32 = dt == at::kFloat && packed.dim() == 3;
  const bool i8 = dt == at::kChar && packed.dim() == 3;
  TORCH_CHECK((bf16 || f32 || i8) && packed.size(2) == kTileCols && packed.is_contiguous(),
              "skinny_linear: a 3-D or 4-D weight must be packed by pack_weight");
  const auto xt = x.scalar_type();
  TORCH_CHECK(i8 ? (xt == at::kFloat || xt == at::kBFloat16) : xt == dt,
              "skinny_linear: a packed weight multiplies x of its own dtype only (int8: "
              "float32 or bfloat16 x)");
  TORCH_CHECK(!i8 || scale != nullptr, "skinny_linear: an int8 weight needs its scale");
  const int64_t m_dim = x.size(0), k_dim = x.size(1), n_dim = packed.size(0) * kTileCols;
  const int64_t packed_k = bf16 ? packed.size(1) * 2 : packed.size(1);
  TORCH_CHECK(packed_k == k_dim, "skinny_linear: packed weight has ", packed_k,
              " input features, x has ", k_dim);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m_dim && out.size(1) == n_dim &&
                  out.is_contiguous() && out.scalar_type() == xt,
              "skinny_linear: out must be [M, N] contiguous in x's dtype");
  TORCH_CHECK(packed_linear_available(dt),
              "skinny_linear: this build has no kernel for a packed ", dt, " weight");
  if (m_dim == 0) return;
#if defined(__AVX512F__)
  if (f32 || i8) {
    // float32 activations (int8 weights take bfloat16 x widened once, a small copy).
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    const float* xp = xf.const_data_ptr<float>();
    if (f32) {
      run_packed<F32>(xp, m_dim, k_dim, packed.const_data_ptr<float>(), n_dim, scale, bias,
                      out.mutable_data_ptr<float>());
    } else if (xt == at::kFloat) {
      run_packed<I8>(xp, m_dim, k_dim, packed.const_data_ptr<int8_t>(), n_dim, scale, bias,
                     out.mutable_data_ptr<float>());
    } else {
      run_packed<I8>(xp, m_dim, k_dim, packed.const_data_ptr<int8_t>(), n_dim, scale, bias,
                     out.mutable_data_ptr<c10::BFloat16>());
    }
    return;
  }
#endif
#if defined(__AVX512BF16__)
  const at::Tensor xc = x.contiguous();
  run_packed<BF16>(xc.const_data_ptr<c10::BFloat16>(), m_dim, k_dim,
                   packed.const_data_ptr<c10::BFloat16>(), n_dim, scale, bias,
                   out.mutable_data_ptr<c10::BFloat16>());
#endif
}

}  // namespace pagectl_cpu
