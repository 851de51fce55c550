// y = x W^T (* scale) (+ bias) for bfloat16 x and a bfloat16 weight packed for AVX512-BF16
// dot products (vdpbf16ps): every row count, one kernel. Called by skinny_linear_out
// (skinny_linear_cpu.cpp) when the weight is 4-D; packed by pack_bf16_weight below, which
// linear.py calls once after loading (the plain [N, K] weight is then freed).
//
// Packed layout: [N / 64, K / 2, 64, 2]. Tile t holds output features 64t .. 64t + 63; for
// each pair of input features (2p, 2p + 1) it stores the 64 features' two weights side by
// side, so four 64-byte loads give a register per 16 output features holding both weights
// of the pair, and one broadcast of x's pair (2p, 2p + 1) multiplies all four: each float32
// lane gains w[n, 2p] x[2p] + w[n, 2p + 1] x[2p + 1] for its own output feature n. No lane
// sums at the end, and a thread reads its tiles' weights as one contiguous stream.
//
// A tile multiplies up to kRows rows of x at a time (kRows x 4 accumulators); more rows
// re-read the tile (K / 2 x 256 bytes: 128 KiB for K = 1024) from L2. One row keeps two sets
// of accumulators (even and odd pairs) so eight chains hide the instruction's latency.
// Products of bfloat16 values are exact in float32: the result is a float32 sum of the exact
// products, then scaled, biased and rounded to bfloat16 once (round to nearest even), as the
// plain kernels do (only the order of the sum differs; denormals are flushed).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"

namespace {

constexpr int64_t kTileCols = 64;

#if defined(__AVX512BF16__)

using bf16 = c10::BFloat16;
constexpr int kRows = 6;  // rows of x per pass over a tile: 24 accumulators

inline __m512bh pair_of(const bf16* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(v));
}

inline __m512bh load_w(const bf16* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

// Stores 16 lanes of output row ``o`` at feature n (scaled, biased, rounded).
inline void store16(__m512 v, bf16* o, const float* scale, const float* bias, int64_t n) {
  if (scale) v = _mm512_mul_ps(v, _mm512_loadu_ps(scale + n));
  if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + n),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// MR rows of x (``ldx`` apart) times one tile, into out rows (``ldo`` apart) at feature n0.
template <int MR>
inline void tile_rows(const bf16* x, int64_t ldx, const bf16* wt, int64_t pairs, bf16* out,
                      int64_t ldo, int64_t n0, const float* scale, const float* bias) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const bf16* w = wt + p * 2 * kTileCols;
    const __m512bh w0 = load_w(w), w1 = load_w(w + 32), w2 = load_w(w + 64), w3 = load_w(w + 96);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = pair_of(x + m * ldx + 2 * p);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xb);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xb);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], w2, xb);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], w3, xb);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) store16(acc[m][j], out + m * ldo, scale, bias, n0 + 16 * j);
}

// One row: even and odd pairs in separate accumulators (eight independent chains).
inline void tile_one_row(const bf16* x, const bf16* wt, int64_t pairs, bf16* out, int64_t n0,
                         const float* scale, const float* bias) {
  __m512 a[2][4];
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j) a[h][j] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + 2 <= pairs; p += 2) {
    for (int h = 0; h < 2; ++h) {
      const bf16* w = wt + (p + h) * 2 * kTileCols;
      const __m512bh xb = pair_of(x + 2 * (p + h));
      for (int j = 0; j < 4; ++j) a[h][j] = _mm512_dpbf16_ps(a[h][j], load_w(w + 32 * j), xb);
    }
  }
  if (p < pairs) {
    const bf16* w = wt + p * 2 * kTileCols;
    const __m512bh xb = pair_of(x + 2 * p);
    for (int j = 0; j < 4; ++j) a[0][j] = _mm512_dpbf16_ps(a[0][j], load_w(w + 32 * j), xb);
  }
  for (int j = 0; j < 4; ++j)
    store16(_mm512_add_ps(a[0][j], a[1][j]), out, scale, bias, n0 + 16 * j);
}

void run_packed(const bf16* x, int64_t m_dim, int64_t k_dim, const bf16* wp, int64_t n_dim,
                const float* scale, const float* bias, bf16* out) {
  const int64_t tiles = n_dim / kTileCols, pairs = k_dim / 2;
  const int64_t tile_elems = pairs * 2 * kTileCols;
  // Rows of x taken together through a thread's tiles: bounded so they stay in L2 while
  // the tiles stream past (K = 1024: 96 rows, 192 KiB).
  const int64_t row_block = std::max<int64_t>(kRows, (196608 / (2 * k_dim)) / kRows * kRows);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m_dim; r0 += row_block) {
      const int64_t r1 = std::min<int64_t>(m_dim, r0 + row_block);
      for (int64_t t = begin; t < end; ++t) {
        const bf16* wt = wp + t * tile_elems;
        const int64_t n0 = t * kTileCols;
        if (m_dim == 1) {
          tile_one_row(x, wt, pairs, out, n0, scale, bias);
          continue;
        }
        int64_t m = r0;
        for (; m + kRows <= r1; m += kRows)
          tile_rows<kRows>(x + m * k_dim, k_dim, wt, pairs, out + m * n_dim, n_dim, n0, scale,
                           bias);
        const bf16* xm = x + m * k_dim;
        bf16* om = out + m * n_dim;
        switch (r1 - m) {
          case 5: tile_rows<5>(xm, k_dim, wt, pairs, om, n_dim, n0, scale, bias); break;
          case 4: tile_rows<4>(xm, k_dim, wt, pairs, om, n_dim, n0, scale, bias); break;
          case 3: tile_rows<3>(xm, k_dim, wt, pairs, om, n_dim, n0, scale, bias); break;
          case 2: tile_rows<2>(xm, k_dim, wt, pairs, om, n_dim, n0, scale, bias); break;
          case 1: tile_rows<1>(xm, k_dim, wt, pairs, om, n_dim, n0, scale, bias); break;
          default: break;
        }
      }
    }
  });
}

#endif  // __AVX512BF16__

}  // namespace

namespace pagectl_cpu {

bool packed_bf16_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_bf16_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "pack_bf16_weight: weight must be a 2-D bfloat16 tensor");
  const int64_t n_dim = weight.size(0), k_dim = weight.size(1);
  TORCH_CHECK(n_dim % kTileCols == 0 && k_dim % 8 == 0 && n_dim > 0 && k_dim > 0,
              "pack_bf16_weight: [N, K] needs N a multiple of 64 and K of 8, got [", n_dim,
              ", ", k_dim, "]");
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({n_dim / kTileCols, k_dim / 2, kTileCols, 2}, w.options());
  const uint32_t* src = reinterpret_cast<const uint32_t*>(w.const_data_ptr());
  uint32_t* dst = reinterpret_cast<uint32_t*>(packed.mutable_data_ptr());
  const int64_t pairs = k_dim / 2;
  at::parallel_for(0, n_dim / kTileCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t c = 0; c < kTileCols; ++c) {
        const uint32_t* row = src + (t * kTileCols + c) * pairs;
        uint32_t* col = dst + t * pairs * kTileCols + c;
        for (int64_t p = 0; p < pairs; ++p) col[p * kTileCols] = row[p];
      }
  });
  return packed;
}

void packed_bf16_linear_out(const at::Tensor& x, const at::Tensor& packed, const float* scale,
                            const float* bias, const at::Tensor& out) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTileCols && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "skinny_linear: a 4-D weight must be a packed bfloat16 weight "
              "(pack_bf16_weight)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16,
              "skinny_linear: a packed bfloat16 weight multiplies bfloat16 x only");
  const int64_t m_dim = x.size(0), k_dim = x.size(1), n_dim = packed.size(0) * kTileCols;
  TORCH_CHECK(packed.size(1) * 2 == k_dim, "skinny_linear: packed weight has ",
              packed.size(1) * 2, " input features, x has ", k_dim);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m_dim && out.size(1) == n_dim &&
                  out.is_contiguous() && out.scalar_type() == at::kBFloat16,
              "skinny_linear: out must be [M, N] contiguous bfloat16");
#if defined(__AVX512BF16__)
  if (m_dim == 0) return;
  const at::Tensor xc = x.contiguous();
  run_packed(xc.const_data_ptr<c10::BFloat16>(), m_dim, k_dim,
             packed.const_data_ptr<c10::BFloat16>(), n_dim, scale, bias,
             out.mutable_data_ptr<c10::BFloat16>());
#else
  TORCH_CHECK(false, "skinny_linear: this build has no AVX512-BF16 kernel for packed weights");
#endif
}

}  // namespace pagectl_cpu
