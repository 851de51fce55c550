// Vector math shared by the CPU kernels (paged_attention_cpu.cpp, prefill_attention_cpu.cpp,
// decode_ops_cpu.cpp, skinny_linear_cpu.cpp):
// GCC/Clang vector extensions, any width.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagectl_cpu {

constexpr float kLog2e = 1.4426950408889634f;
// ln 2 as a high part with few mantissa bits (so n * kLn2Hi is exact) plus the remainder.
constexpr float kLn2Hi = 0.693145751953125f;
constexpr float kLn2Lo = 1.4286068203094172e-06f;
// Below this, exp() would leave the normal range; the result is then exp(kExpFloor).
constexpr float kExpFloor = -87.0f;

// exp(x) for x <= 0 (softmax arguments are score - running max), -inf included: x = n ln2
// + r with |r| <= ln2 / 2, exp(r) by its Taylor series to degree 7 (relative error below
// 1e-8, under float rounding), 2^n built in the exponent bits. Arguments below kExpFloor
// give exp(kExpFloor) ~ 1.6e-38: negligible beside the max term's 1. n is rounded by
// truncating x log2(e) - 1/2 toward zero, which rounds to nearest for x <= 0.
template <typename V, typename IV>
inline V exp_nonpositive(V x) {
  x = x < kExpFloor ? kExpFloor : x;
  const IV ni = __builtin_convertvector(x * kLog2e - 0.5f, IV);
  const V n = __builtin_convertvector(ni, V);
  const V r = (x - n * kLn2Hi) - n * kLn2Lo;
  V p = r * (1.0f / 5040.0f) + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const IV bits = (ni + 127) << 23;
  V two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// bfloat16 bits (the top halves of float32s) widened to floats, any width: U16V and U32V are
// the 16- and 32-bit unsigned vectors of V's width.
// With AVX-512 (16 lanes) or AVX2 (8 lanes) it is one widening load and one shift: GCC
// compiles the generic form at those widths into two half-width loads, an extract, two
// widenings and an insert.
template <typename V, typename U16V, typename U32V>
inline V bf16_to_float(const void* p) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) {
    const __m512i wide = _mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p))), 16);
    V v;
    std::memcpy(&v, &wide, sizeof v);
    return v;
  }
#endif
#if defined(__AVX2__)
  if constexpr (sizeof(V) == 32) {
    const __m256i wide = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p))), 16);
    V v;
    std::memcpy(&v, &wide, sizeof v);
    return v;
  }
#endif
  U16V raw;
  std::memcpy(&raw, p, sizeof raw);
  const U32V wide = __builtin_convertvector(raw, U32V) << 16;
  V v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

// Floats rounded to bfloat16 (to nearest, ties to even; NaN to the quiet NaN 0x7FC0), as
// c10::BFloat16's constructor rounds, any width, stored to p. U32V and U16V are the 32- and
// 16-bit unsigned vectors of V's width.
template <typename V, typename U32V, typename U16V>
inline void float_to_bf16(V v, void* p) {
  U32V bits;
  std::memcpy(&bits, &v, sizeof bits);
  const U32V rounded = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) >> 16;
  const U32V nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  const U32V out = nan ? U32V{} + 0x7FC0u : rounded;
  const U16V narrow = __builtin_convertvector(out, U16V);
  std::memcpy(p, &narrow, sizeof narrow);
}

// Lane sum and lane max of a float vector of any power-of-two width, as trees of halves (a
// serial loop over the lanes is one long dependent chain): each level adds (or takes the
// larger of) the low and high halves, down to four lanes, summed as (0 + 2) + (1 + 3).
template <int N>
struct FloatVec {
  typedef float type __attribute__((vector_size(N * sizeof(float))));
};

template <typename V>
inline void split_halves(V v, typename FloatVec<sizeof(V) / sizeof(float) / 2>::type& lo,
                         typename FloatVec<sizeof(V) / sizeof(float) / 2>::type& hi) {
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
}

template <typename V>
inline float lane_sum(V v) {
  constexpr int n = sizeof(V) / sizeof(float);
  static_assert(n >= 4 && (n & (n - 1)) == 0, "lane_sum: 4, 8, 16 ... lanes");
  if constexpr (n == 4) {
    return (v[0] + v[2]) + (v[1] + v[3]);
  } else {
    typename FloatVec<n / 2>::type lo, hi;
    split_halves(v, lo, hi);
    return lane_sum(lo + hi);
  }
}

template <typename V>
inline float lane_max(V v) {
  constexpr int n = sizeof(V) / sizeof(float);
  static_assert(n >= 4 && (n & (n - 1)) == 0, "lane_max: 4, 8, 16 ... lanes");
  if constexpr (n == 4) {
    const float a = v[0] > v[1] ? v[0] : v[1], b = v[2] > v[3] ? v[2] : v[3];
    return a > b ? a : b;
  } else {
    typename FloatVec<n / 2>::type lo, hi;
    split_halves(v, lo, hi);
    return lane_max(lo > hi ? lo : hi);
  }
}

}  // namespace pagectl_cpu
