// Paged attention for decode rows on CPU, reading K/V in place through the block table.
//
// Registered as torch.ops.pagectl_cpu.paged_decode; built and loaded by
// pagectl/engine/attention/cpu_build.py, called by cpu_kernel.py.
//
// One work item is a decode sequence (or, when there are fewer sequences than twice the
// threads, a range of its KV heads). All query heads of the item are processed together,
// the query heads that share a KV head (the GQA group) included, so every cached K/V row is
// read once per layer and step. Keys are visited block by block in block-table order, the
// next blocks prefetched (scattered blocks defeat the hardware prefetcher at each jump).
// Within a block, each KV head's key rows are multiplied by its query heads two at a time,
// both kept in registers (each key row loaded once per pair); the dot products of a
// register's width of keys wait as vectors and one shuffle-and-add network (fold_all) turns
// them into that many scores, where a horizontal sum per key cost twice the operations.
// Value rows are likewise loaded once per pair of query heads. The softmax is online (a running max and sum per query head; the
// accumulator is rescaled when the max grows), all in float32 whatever the cache dtype.
// Work items are split among torch's intra-op threads in contiguous ranges of about equal
// key counts, so that the sorted short and long sequences balance.
//
// Arithmetic is written with GCC/Clang vector extensions on one register of the build's
// target: 16 floats with AVX-512, 8 otherwise (one AVX2 register, two SSE or NEON ones). A
// vector wider than the target's registers is not kept in registers by the compilers: with
// 16-float vectors on AVX2, GCC spilled the accumulators and dot products to the stack
// (about 100 ns per key and query head at head_dim 64, against 8-float vectors' few).
// Head sizes of 16, 32, 64, 80, 96 and 128 take the vector path; others a scalar one.
//
// Layouts (checked at the boundary):
//   q, out        [rows, num_heads, head_dim], last dim contiguous, any row / head stride;
//                 row i is the single query of sequence i (rows = sequences here)
//   kv_cache      [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous
//   block_tables  int32 [>= rows, width], rows contiguous; entries past a sequence's
//                 blocks are never read
//   seq_lens      int32 [>= rows]: keys of each sequence, the token just written included

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "cpu_vec_math.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using pagectl_cpu::exp_nonpositive;

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kVectorRegs = 32;
#else
constexpr int kLanes = 8;
constexpr int kVectorRegs = 16;
#endif
typedef float vecw __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t ivecw __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint16_t u16vecw __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t u32vecw __attribute__((vector_size(kLanes * sizeof(uint32_t))));


typedef float vec1 __attribute__((vector_size(sizeof(float))));
typedef int32_t ivec1 __attribute__((vector_size(sizeof(int32_t))));

inline float exp_nonpositive_scalar(float x) {
  const vec1 v = {x};
  return exp_nonpositive<vec1, ivec1>(v)[0];
}

// Lane sums of kLanes vectors at once: fold_all<kLanes>(d) leaves in d[0] the vector whose
// lane i is the sum of d[i]'s lanes (the other d[] are overwritten). Each level pairs d[i]
// with d[i + W / 2] and adds the low and high halves of every group of W lanes of both,
// halving the group width: kLanes - 1 pairings of two shuffles and an add, where kLanes
// separate horizontal sums would take about twice as many operations. Pairing i with
// i + W / 2 leaves the sums in key order.
template <int W>
struct FoldMasks {
  int lo[kLanes], hi[kLanes];
  constexpr FoldMasks() : lo(), hi() {
    int i = 0;
    for (int g = 0; g < kLanes / W; ++g) {
      for (int src = 0; src < 2; ++src) {  // X's group g, then Y's
        for (int e = 0; e < W / 2; ++e, ++i) {
          lo[i] = src * kLanes + g * W + e;
          hi[i] = src * kLanes + g * W + W / 2 + e;
        }
      }
    }
  }
};

template <int W>
inline vecw fold(vecw x, vecw y) {
  static constexpr FoldMasks<W> kMasks;
  ivecw lo, hi;
  std::memcpy(&lo, kMasks.lo, sizeof lo);
  std::memcpy(&hi, kMasks.hi, sizeof hi);
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

template <int W>
inline void fold_all(vecw* d) {
  if constexpr (W > 1) {
    for (int i = 0; i < W / 2; ++i) d[i] = fold<W>(d[i], d[i + W / 2]);
    fold_all<W / 2>(d);
  }
}

// q . k over kChunks vectors (two partial sums: half the dependent chain of one), as a
// vector whose lanes sum to the dot product.
template <int kChunks>
inline vecw dot_chunks(const vecw* q, const vecw* k) {
  vecw dot = q[0] * k[0];
  vecw dot2 = vecw{};
  for (int c = 1; c + 1 < kChunks; c += 2) {
    dot2 += q[c] * k[c];
    dot += q[c + 1] * k[c + 1];
  }
  if constexpr (kChunks % 2 == 0) {
    if constexpr (kChunks > 1) dot2 += q[kChunks - 1] * k[kChunks - 1];
  }
  return dot + dot2;
}

// 16 consecutive elements as floats.
inline vecw loadw(const float* p) {
  vecw v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vecw loadw(const c10::BFloat16* p) {
  return pagectl_cpu::bf16_to_float<vecw, u16vecw, u32vecw>(p);
}

inline vecw loadw(const c10::Half* p) {
  float tmp[kLanes];
  for (int i = 0; i < kLanes; ++i) {
    tmp[i] = static_cast<float>(p[i]);
  }
  return loadw(tmp);
}

// One query head's operand for the vector path's scores: ``load`` takes head j (its
// scaled float32 copy in Work::qv, or its row of q), ``dot`` returns a vector whose lanes
// sum to q . k for one key row, and kScale says whether the scores still need the scale.

// float32 arithmetic on the scaled query and the key widened to float32.
template <typename scalar_t, int kChunks>
struct FloatQuery {
  static constexpr bool kScale = false;
  vecw q[kChunks];
  void load(const vecw* qv, const scalar_t* /*row*/) {
    for (int c = 0; c < kChunks; ++c) q[c] = qv[c];
  }
  vecw dot(const scalar_t* k) const {
    vecw kv[kChunks];
    for (int c = 0; c < kChunks; ++c) kv[c] = loadw(k + c * kLanes);
    return dot_chunks<kChunks>(q, kv);
  }
};

#if defined(__AVX512BF16__)
// A bfloat16 cache on a CPU with AVX512-BF16, the head a whole number of 32-element
// registers: bfloat16 dot products (vdpbf16ps) of q and k as stored. One instruction
// multiplies 32 elements and adds the products (exact in float32) to 16 float32 lanes,
// where widening both took two loads, two shifts and two FMAs; denormals are flushed as
// vdpbf16ps does. The scale is applied to each score instead of to q. (AVX512-BF16 implies
// AVX-512: kLanes is 16, half a register of bfloat16.)
template <typename scalar_t, int kChunks>
constexpr bool kDotBf16 =
    std::is_same_v<scalar_t, c10::BFloat16> && kChunks >= 2 && kChunks % 2 == 0;

template <int kChunks>
struct Bf16Query {
  static constexpr bool kScale = true;
  static constexpr int kPairs = kChunks / 2;
  __m512bh q[kPairs];
  void load(const vecw* /*qv*/, const c10::BFloat16* row) {
    for (int c = 0; c < kPairs; ++c) {
      q[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(row + 32 * c));
    }
  }
  vecw dot(const c10::BFloat16* k) const {
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();  // two chains
    for (int c = 0; c < kPairs; ++c) {
      const __m512bh kc = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k + 32 * c));
      if (c % 2) {
        b = _mm512_dpbf16_ps(b, kc, q[c]);
      } else {
        a = _mm512_dpbf16_ps(a, kc, q[c]);
      }
    }
    return reinterpret_cast<vecw>(_mm512_add_ps(a, b));
  }
};

template <typename scalar_t, int kChunks>
struct QueryFor {
  using type = std::conditional_t<kDotBf16<scalar_t, kChunks>, Bf16Query<kChunks>,
                                  FloatQuery<scalar_t, kChunks>>;
};
#else
template <typename scalar_t, int kChunks>
struct QueryFor {
  using type = FloatQuery<scalar_t, kChunks>;
};
#endif

// Prefetches go to L2 (prefetcht1, locality 2), not L1: a block's K or V rows reach L1 soon
// enough from there, and L1-bound prefetches (prefetcht0) of the next block's lines were
// as slow as no prefetch at all once K/V came from DRAM. Measured on an AVX-512 Zen 4
// machine, 20 sequences x 450 keys over 8 layers' caches (74 MB of bfloat16 K/V, 2 threads):
// 5.2-5.7 ms a step with prefetcht0 (13-14 GB/s), 5.3-5.4 with none, 2.6-3.2 with prefetcht1;
// 6.2-6.9 against 3.3-3.5 ms with the blocks in random order; float32 8.9 against 6.6 ms
// (docs/PERFORMANCE.md, section 12).
constexpr int kPrefetchLocality = 2;

// Touches the first cache line of every 4 KiB page that rows [0, rows) of a block (row_bytes
// each, row_stride apart) occupy. Blocks are scattered, so each page of a block starts cold;
// touching it two blocks ahead starts its DRAM fetch and the hardware prefetcher's stream.
inline void prefetch_pages(const void* start, int64_t rows, int64_t row_stride,
                           int64_t row_bytes) {
  const char* p = static_cast<const char*>(start);
  constexpr int64_t kPage = 4096;
  const int64_t step = std::max<int64_t>(1, kPage / row_stride);
  for (int64_t t = 0; t < rows; t += step) {
    for (int64_t e = 0; e < row_bytes; e += kPage) {
      __builtin_prefetch(p + t * row_stride + e, 0, kPrefetchLocality);
    }
  }
}

// Prefetches the bytes [p, p + bytes) line by line (a K or V row of one head).
inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t e = 0; e < bytes; e += 64) {
    __builtin_prefetch(c + e, 0, kPrefetchLocality);
  }
}

// Below this many (key, query head, head_dim element) products a call is not split.
constexpr int64_t kSerialElems = 1 << 18;

struct DecodeShape {
  int64_t num_kv_heads;
  int64_t group;  // query heads per KV head
  int64_t block_size;
  int64_t head_dim;
  int64_t q_row_stride, q_head_stride;
  int64_t out_row_stride, out_head_stride;
  int64_t table_stride;
  float scale;
};

// Scratch of one work item: nq = (h1 - h0) * group query heads.
struct Work {
  std::vector<vecw> qv, acc;  // [nq, head_dim / kLanes] (vector path)

  std::vector<float> qf, accf;  // [nq, head_dim] (scalar path)
  std::vector<float> scores;    // [nq, score_stride]: a block's scores, then its weights
  std::vector<float> run_max, run_sum;  // [nq]
};

// Scores of one head are this far apart: the block size rounded up to whole vectors (the
// lane sums store kLanes of them at once).
inline int64_t score_stride(int64_t block_size) {
  return (block_size + kLanes - 1) / kLanes * kLanes;
}

// Folds one block's scores (scores[j * bs + t], t < n; bs here is the score stride) into the running softmax of each
// query head: replaces them by their weights exp(score - new max) and returns, through
// alpha[j], the factor the head's accumulator must be scaled by first.
inline void softmax_block(int64_t nq, int64_t bs, int64_t n, float* scores, float* run_max,
                          float* run_sum, float* alpha) {
  for (int64_t j = 0; j < nq; ++j) {
    float* sj = scores + j * bs;
    float m = run_max[j];
    int64_t t0 = 0;
    if (n >= kLanes) {
      // A register's width of keys at a time (a scalar running max is one long chain).
      vecw mv = loadw(sj);
      for (t0 = kLanes; t0 + kLanes <= n; t0 += kLanes) {
        const vecw x = loadw(sj + t0);
        mv = x > mv ? x : mv;
      }
      const float bm = pagectl_cpu::lane_max(mv);
      m = bm > m ? bm : m;
    }
    for (int64_t t = t0; t < n; ++t) {
      m = sj[t] > m ? sj[t] : m;
    }
    float total = 0.0f;
    int64_t t = 0;
    if (n >= kLanes) {
      vecw sum = {};
      for (; t + kLanes <= n; t += kLanes) {
        const vecw e = exp_nonpositive<vecw, ivecw>(loadw(sj + t) - m);
        std::memcpy(sj + t, &e, sizeof e);
        sum += e;
      }
      total = pagectl_cpu::lane_sum(sum);
    }
    for (; t < n; ++t) {
      sj[t] = exp_nonpositive_scalar(sj[t] - m);
      total += sj[t];
    }
    alpha[j] = m > run_max[j] ? exp_nonpositive_scalar(run_max[j] - m) : 1.0f;
    run_sum[j] = run_sum[j] * alpha[j] + total;
    run_max[j] = m;
  }
}

// One sequence's query heads that share KV heads [h0, h1), over its cached keys.
// kChunks = head_dim / kLanes > 0 takes the vector path with the head size fixed at compile
// time; 0 the scalar path for any head size.
template <typename scalar_t, int kChunks>
void attend_seq(const DecodeShape& s, const scalar_t* q, const scalar_t* k_cache,
                const scalar_t* v_cache, const int32_t* blocks, int64_t seq_len, int64_t h0,
                int64_t h1, scalar_t* out, Work& w) {
  const int64_t D = s.head_dim;
  const int64_t G = s.group;
  const int64_t nq = (h1 - h0) * G;  // local query head j is global head h0 * G + j
  const int64_t bs = s.block_size;
  const int64_t ss = score_stride(bs);
  constexpr bool kVector = kChunks > 0;
  float* scores = w.scores.data();
  float* run_max = w.run_max.data();
  float* run_sum = w.run_sum.data();
  std::vector<float>& alpha = w.accf;  // reused: [nq] on the vector path
  if (kVector) {
    alpha.resize(nq);
  }
  for (int64_t j = 0; j < nq; ++j) {
    const scalar_t* qj = q + (h0 * G + j) * s.q_head_stride;
    if constexpr (kVector) {
      for (int c = 0; c < kChunks; ++c) {
        w.qv[j * kChunks + c] = loadw(qj + c * kLanes) * s.scale;
        w.acc[j * kChunks + c] = vecw{};
      }
    } else {
      for (int64_t d = 0; d < D; ++d) {
        w.qf[j * D + d] = static_cast<float>(qj[d]) * s.scale;
        w.accf[nq + j * D + d] = 0.0f;
      }
    }
    run_max[j] = -std::numeric_limits<float>::infinity();
    run_sum[j] = 0.0f;
  }
  const int64_t token_stride = s.num_kv_heads * D;
  const int64_t block_stride = bs * token_stride;
  const int64_t row_bytes = (h1 - h0) * D * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t num_blocks = (seq_len + bs - 1) / bs;
  float* alpha_p = kVector ? alpha.data() : w.accf.data();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t n = std::min(bs, seq_len - b * bs);
    const int64_t base = static_cast<int64_t>(blocks[b]) * block_stride + h0 * D;
    const scalar_t* kb = k_cache + base;
    const scalar_t* vb = v_cache + base;
    const int64_t stride_bytes = token_stride * static_cast<int64_t>(sizeof(scalar_t));
    if (b + 2 < num_blocks) {
      const int64_t far = static_cast<int64_t>(blocks[b + 2]) * block_stride + h0 * D;
      const int64_t n_far = std::min(bs, seq_len - (b + 2) * bs);
      prefetch_pages(k_cache + far, n_far, stride_bytes, row_bytes);
      prefetch_pages(v_cache + far, n_far, stride_bytes, row_bytes);
    }
    // The next block's rows are prefetched line by line, spread over this block's loops (a
    // burst of them at once stalls on the limit of outstanding misses).
    const bool has_next = b + 1 < num_blocks;
    const int64_t n_next = has_next ? std::min(bs, seq_len - (b + 1) * bs) : 0;
    const int64_t next = has_next ? static_cast<int64_t>(blocks[b + 1]) * block_stride + h0 * D : 0;
    const scalar_t* kn = k_cache + next;
    const scalar_t* vn = v_cache + next;
    const int64_t head_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
    // Scores. Vector path: kLanes keys at a time, for each KV head and each pair of its
    // query heads (both kept in registers, so each key row is loaded once per pair): the
    // keys' dot products wait as vectors and fold_all turns them into kLanes scores. The
    // next block's key rows are prefetched as the keys go. Scalar path: key by key.
    if constexpr (kVector) {
      using Query = typename QueryFor<scalar_t, kChunks>::type;
      const auto q_row = [&](int64_t j) { return q + (h0 * G + j) * s.q_head_stride; };
      for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
        const int64_t nt = std::min<int64_t>(kLanes, n - t0);
        for (int64_t t = t0; t < t0 + nt && t < n_next; ++t) {
          for (int64_t h = 0; h < h1 - h0; ++h) {
            prefetch_lines(kn + t * token_stride + h * D, head_bytes);
          }
        }
        for (int64_t h = 0; h < h1 - h0; ++h) {
          const scalar_t* kh = kb + t0 * token_stride + h * D;
          int64_t g = 0;
          for (; g + 2 <= G; g += 2) {
            const int64_t j = h * G + g;
            Query qa, qb;
            qa.load(&w.qv[j * kChunks], q_row(j));
            qb.load(&w.qv[(j + 1) * kChunks], q_row(j + 1));
            vecw da[kLanes], db[kLanes];
            for (int64_t t = 0; t < nt; ++t) {
              da[t] = qa.dot(kh + t * token_stride);
              db[t] = qb.dot(kh + t * token_stride);
            }
            for (int64_t t = nt; t < kLanes; ++t) da[t] = db[t] = vecw{};
            fold_all<kLanes>(da);
            fold_all<kLanes>(db);
            if constexpr (Query::kScale) {
              da[0] *= s.scale;
              db[0] *= s.scale;
            }
            std::memcpy(scores + j * ss + t0, da, sizeof(vecw));
            std::memcpy(scores + (j + 1) * ss + t0, db, sizeof(vecw));
          }
          for (; g < G; ++g) {
            const int64_t j = h * G + g;
            Query qa;
            qa.load(&w.qv[j * kChunks], q_row(j));
            vecw da[kLanes];
            for (int64_t t = 0; t < nt; ++t) da[t] = qa.dot(kh + t * token_stride);
            for (int64_t t = nt; t < kLanes; ++t) da[t] = vecw{};
            fold_all<kLanes>(da);
            if constexpr (Query::kScale) da[0] *= s.scale;
            std::memcpy(scores + j * ss + t0, da, sizeof(vecw));
          }
        }
      }
    } else {
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t h = 0; h < h1 - h0; ++h) {
          const scalar_t* kr = kb + t * token_stride + h * D;
          if (t < n_next) {
            prefetch_lines(kn + t * token_stride + h * D, head_bytes);
          }
          for (int64_t g = 0; g < G; ++g) {
            const float* qj = w.qf.data() + (h * G + g) * D;
            float dot = 0.0f;
            for (int64_t d = 0; d < D; ++d) {
              dot += qj[d] * static_cast<float>(kr[d]);
            }
            scores[(h * G + g) * ss + t] = dot;
          }
        }
      }
    }
    softmax_block(nq, ss, n, scores, run_max, run_sum, alpha_p);
    // Values: each query head's accumulator stays in registers over the block's rows; on
    // the vector path two query heads of a KV head share each value row's load (where their
    // accumulators and the row fit the registers).
    for (int64_t h = 0; h < h1 - h0; ++h) {
      int64_t g = 0;
      if constexpr (kVector && 3 * kChunks <= kVectorRegs - 4) {
        for (; g + 2 <= G; g += 2) {
          const int64_t j = h * G + g;
          const float* p0 = scores + j * ss;
          const float* p1 = p0 + ss;
          vecw a0[kChunks], a1[kChunks];
          for (int c = 0; c < kChunks; ++c) {
            a0[c] = w.acc[j * kChunks + c] * alpha_p[j];
            a1[c] = w.acc[(j + 1) * kChunks + c] * alpha_p[j + 1];
          }
          for (int64_t t = 0; t < n; ++t) {
            const scalar_t* vr = vb + t * token_stride + h * D;
            if (g == 0 && t < n_next) {
              prefetch_lines(vn + t * token_stride + h * D, head_bytes);
            }
            for (int c = 0; c < kChunks; ++c) {
              const vecw v = loadw(vr + c * kLanes);
              a0[c] += p0[t] * v;
              a1[c] += p1[t] * v;
            }
          }
          for (int c = 0; c < kChunks; ++c) {
            w.acc[j * kChunks + c] = a0[c];
            w.acc[(j + 1) * kChunks + c] = a1[c];
          }
        }
      }
      for (; g < G; ++g) {
        const int64_t j = h * G + g;
        const float* pj = scores + j * ss;
        if constexpr (kVector) {
          vecw a[kChunks];
          for (int c = 0; c < kChunks; ++c) {
            a[c] = w.acc[j * kChunks + c] * alpha_p[j];
          }
          for (int64_t t = 0; t < n; ++t) {
            const scalar_t* vr = vb + t * token_stride + h * D;
            if (g == 0 && t < n_next) {
              prefetch_lines(vn + t * token_stride + h * D, head_bytes);
            }
            for (int c = 0; c < kChunks; ++c) {
              a[c] += pj[t] * loadw(vr + c * kLanes);
            }
          }
          for (int c = 0; c < kChunks; ++c) {
            w.acc[j * kChunks + c] = a[c];
          }
        } else {
          float* aj = w.accf.data() + nq + j * D;
          for (int64_t d = 0; d < D; ++d) {
            aj[d] *= alpha_p[j];
          }
          for (int64_t t = 0; t < n; ++t) {
            const scalar_t* vr = vb + t * token_stride + h * D;
            for (int64_t d = 0; d < D; ++d) {
              aj[d] += pj[t] * static_cast<float>(vr[d]);
            }
          }
        }
      }
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    const float inv = 1.0f / run_sum[j];
    scalar_t* oj = out + (h0 * G + j) * s.out_head_stride;
    for (int64_t d = 0; d < D; ++d) {
      const float a = kVector ? w.acc[j * kChunks + d / kLanes][d % kLanes]
                              : w.accf[nq + j * D + d];
      oj[d] = static_cast<scalar_t>(a * inv);
    }
  }
}

template <typename scalar_t, int kChunks>
void decode_all(const DecodeShape& s, int64_t num_seqs, const scalar_t* q,
                const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* tables,
                const int32_t* seq_lens, scalar_t* out) {
  // Little work (a short context of one or two sequences) runs on the calling thread: waking
  // the others costs more than it saves (with waiting threads asleep, 105 us against the
  // about 25 us one thread takes over 200 keys of 8 query heads at head_dim 64).
  int64_t total_keys = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    total_keys += seq_lens[i];
  }
  const bool small = total_keys * s.num_kv_heads * s.group * s.head_dim < kSerialElems;
  const int64_t threads = small ? 1 : at::get_num_threads();
  // A work item is a sequence's KV heads split in `parts` ranges: whole sequences unless
  // there are too few sequences to keep the threads busy.
  const int64_t parts =
      std::min<int64_t>(s.num_kv_heads, (2 * threads + num_seqs - 1) / num_seqs);
  const int64_t heads_per_part = (s.num_kv_heads + parts - 1) / parts;
  const int64_t num_items = num_seqs * parts;
  const int64_t num_chunks = std::min<int64_t>(threads, num_items);
  // Contiguous chunks of items (sequence-major) with about equal key counts.
  std::vector<int64_t> bounds(num_chunks + 1, num_items);
  bounds[0] = 0;
  const int64_t total = total_keys * parts;
  int64_t done = 0;
  int64_t chunk = 1;
  for (int64_t item = 0; item < num_items && chunk < num_chunks; ++item) {
    done += seq_lens[item / parts];
    while (chunk < num_chunks && done * num_chunks >= chunk * total) {
      bounds[chunk++] = item + 1;
    }
  }
  const int64_t nq = heads_per_part * s.group;
  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    Work w;
    if constexpr (kChunks > 0) {
      w.qv.resize(nq * kChunks);
      w.acc.resize(nq * kChunks);
    } else {
      w.qf.resize(nq * s.head_dim);
      w.accf.resize(nq + nq * s.head_dim);  // [nq] rescale factors, then [nq, head_dim]
    }
    w.scores.resize(nq * score_stride(s.block_size));
    w.run_max.resize(nq);
    w.run_sum.resize(nq);
    for (int64_t c = begin; c < end; ++c) {
      for (int64_t item = bounds[c]; item < bounds[c + 1]; ++item) {
        const int64_t i = item / parts;
        const int64_t h0 = (item % parts) * heads_per_part;
        const int64_t h1 = std::min(s.num_kv_heads, h0 + heads_per_part);
        if (h0 < h1) {
          attend_seq<scalar_t, kChunks>(s, q + i * s.q_row_stride, k_cache, v_cache,
                                        tables + i * s.table_stride, seq_lens[i], h0, h1,
                                        out + i * s.out_row_stride, w);
        }
      }
    }
  });
}

template <typename scalar_t>
void decode_typed(const DecodeShape& s, int64_t rows, const at::Tensor& q,
                  const at::Tensor& kv_cache, const int32_t* tables, const int32_t* lens,
                  const at::Tensor& out) {
  const scalar_t* qp = q.const_data_ptr<scalar_t>();
  const scalar_t* k = kv_cache.const_data_ptr<scalar_t>();
  const scalar_t* v = k + kv_cache.stride(0);
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  switch (s.head_dim) {
    case 16:
      decode_all<scalar_t, 16 / kLanes>(s, rows, qp, k, v, tables, lens, o);
      break;
    case 32:
      decode_all<scalar_t, 32 / kLanes>(s, rows, qp, k, v, tables, lens, o);
      break;
    case 64:
      decode_all<scalar_t, 64 / kLanes>(s, rows, qp, k, v, tables, lens, o);
      break;
    case 80:
      decode_all<scalar_t, 80 / kLanes>(s, rows, qp, k, v, tables, lens, o);
      break;
    case 96:
      decode_all<scalar_t, 96 / kLanes>(s, rows, qp, k, v, tables, lens, o);
      break;
    case 128:
      decode_all<scalar_t, 128 / kLanes>(s, rows, qp, k, v, tables, lens, o);
      break;
    default:
      decode_all<scalar_t, 0>(s, rows, qp, k, v, tables, lens, o);
  }
}

}  // namespace

namespace pagectl_cpu {

void paged_decode(const at::Tensor& q, const at::Tensor& kv_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                  const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3, "q and out must be [rows, heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache must be [2, blocks, ...]");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "q and out dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables must be [seqs, width] with contiguous rows");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.is_contiguous(), "seq_lens must be contiguous");
  const int64_t rows = q.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_dim, "kv_cache head_dim differs from q's");
  TORCH_CHECK(out.size(0) == rows && out.size(1) == num_heads && out.size(2) == head_dim,
              "out shape differs from q's");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need a contiguous last dim");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.size(0) >= rows && seq_lens.size(0) >= rows,
              "fewer block-table rows or lengths than query rows");
  if (rows == 0) {
    return;
  }
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int64_t width = block_tables.size(1);
  const int64_t pool_blocks = kv_cache.size(1);
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= width * block_size,
                "sequence length out of range of its block table");
    const int32_t* row = tables + i * block_tables.stride(0);
    for (int64_t b = 0; b < (lens[i] + block_size - 1) / block_size; ++b) {
      TORCH_CHECK(row[b] >= 0 && row[b] < pool_blocks, "block id out of range of the pool");
    }
  }
  const DecodeShape s{num_kv_heads,         num_heads / num_kv_heads,
                      block_size,           head_dim,
                      q.stride(0),          q.stride(1),
                      out.stride(0),        out.stride(1),
                      block_tables.stride(0), static_cast<float>(scale)};
  switch (q.scalar_type()) {
    case at::kFloat:
      decode_typed<float>(s, rows, q, kv_cache, tables, lens, out);
      break;
    case at::kBFloat16:
      decode_typed<c10::BFloat16>(s, rows, q, kv_cache, tables, lens, out);
      break;
    case at::kHalf:
      decode_typed<c10::Half>(s, rows, q, kv_cache, tables, lens, out);
      break;
    default:
      TORCH_CHECK(false, "paged_decode supports float32, bfloat16 and float16, got ",
                  q.scalar_type());
  }
}

}  // namespace pagectl_cpu

TORCH_LIBRARY(pagectl_cpu, m) {
  m.def(
      "paged_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagectl_cpu, CPU, m) {
  m.impl("paged_decode", &pagectl_cpu::paged_decode);
}
