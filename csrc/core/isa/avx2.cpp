// The AVX2 + FMA kernel set, float32 words. The attention GEMM works in blocks of 6 rows x 16
// columns (12 ymm accumulators); the indexer's score tile in blocks of 6 rows x 16 keys that walk
// the 64-key tile in four column passes.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "../kernels/kernel_set.h"
#include "../kernels/row_blocks.h"
#include "f32_decode.h"
#include "row_ops.h"
#include "row_packing.h"
#include "sets.h"

namespace opmesh::core::kernels::avx2 {
namespace {

// acc[r] += A[r][d] * B[d][0..16) over the depth: kRows rows of A (lda apart) against 16 columns
// of B (ldb apart), the GEMM's and the score tile's shared inner loop.
template <int kRows>
inline void accumulate(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t depth,
                       __m256 (&acc)[kRows][2]) {
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < depth; ++d) {
    const __m256 b0 = _mm256_loadu_ps(b + d * ldb);
    const __m256 b1 = _mm256_loadu_ps(b + d * ldb + 8);
    for (int r = 0; r < kRows; ++r) {
      const __m256 ab = _mm256_broadcast_ss(a + r * lda + d);
      acc[r][0] = _mm256_fmadd_ps(ab, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(ab, b1, acc[r][1]);
    }
  }
}

template <int kRows>
void block(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t depth, float* c,
           int64_t ldc, const float* row_scale, float alpha) {
  __m256 acc[kRows][2];
  accumulate<kRows>(a, lda, b, ldb, depth, acc);
  const __m256 scale = _mm256_set1_ps(alpha);
  for (int r = 0; r < kRows; ++r) {
    float* out = c + r * ldc;
    for (int j = 0; j < 2; ++j) {
      __m256 v = _mm256_mul_ps(scale, acc[r][j]);
      if (row_scale != nullptr) {
        v = _mm256_fmadd_ps(_mm256_set1_ps(row_scale[r]), _mm256_loadu_ps(out + 8 * j), v);
      }
      _mm256_storeu_ps(out + 8 * j, v);
    }
  }
}

void gemm(const GemmArgs& g) {
  const float* a = static_cast<const float*>(g.a);
  const float* b = static_cast<const float*>(g.b);
  for (int64_t col = 0; col < g.n; col += 16) {
    for_each_even_row_block<6>(0, static_cast<int>(g.m), [&](auto rows, int r) {
      block<decltype(rows)::value>(a + r * g.lda, g.lda, b + col, g.ldb, g.depth,
                                   g.c + r * g.ldc + col, g.ldc,
                                   g.row_scale ? g.row_scale + r : nullptr, g.alpha);
    });
  }
}

// exp(x) for x <= 0; see avx512.cpp. Below -87 the result is 0 (no subnormals), NaN stays.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(underflow, r);
}

void softmax(float* s, int64_t rows, int64_t cols, float* m, float* l, float* correction) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* x = s + r * cols;
    __m256 top = _mm256_set1_ps(m[r]);
    __m256 nan = _mm256_setzero_ps();
    for (int64_t j = 0; j < cols; j += 8) {
      const __m256 v = _mm256_loadu_ps(x + j);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      top = _mm256_max_ps(top, v);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    float row_max = lanes[0];
    for (int j = 1; j < 8; ++j) row_max = lanes[j] > row_max ? lanes[j] : row_max;
    if (_mm256_movemask_ps(nan) != 0 || m[r] != m[r]) {
      row_max = std::numeric_limits<float>::quiet_NaN();
    }
    if (row_max == kNegInf) {
      for (int64_t j = 0; j < cols; j += 8) _mm256_storeu_ps(x + j, _mm256_setzero_ps());
      correction[r] = 1.0f;
      continue;
    }
    const __m256 mv = _mm256_set1_ps(row_max);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < cols; j += 8) {
      const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv));
      sum = _mm256_add_ps(sum, p);
      _mm256_storeu_ps(x + j, p);
    }
    _mm256_store_ps(lanes, sum);
    float total = 0.0f;
    for (int j = 0; j < 8; ++j) total += lanes[j];
    correction[r] = std::exp(m[r] - row_max);
    l[r] = l[r] * correction[r] + total;
    m[r] = row_max;
  }
}

void exp_rows(float* s, int64_t rows, int64_t cols, const float* shift) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 m = _mm256_set1_ps(shift[r]);
    for (int64_t c = 0; c < cols; c += 8) {
      float* x = s + r * cols + c;
      _mm256_storeu_ps(x, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x), m)));
    }
  }
}

constexpr int kTile = kKeyTile;
constexpr int kCols = 2;  // ymm registers of 8 keys per row

template <int kRows>
inline void score_block(const float* q, int64_t depth, const float* k, const float* w, int w_stride,
                        float* scores) {
  __m256 acc[kRows][kCols];
  accumulate<kRows>(q, depth, k, kTile, depth, acc);
  const __m256 zero = _mm256_setzero_ps();  // max(zero, acc): a NaN dot product stays NaN
  for (int r = 0; r < kRows; ++r) {
    const __m256 wb = _mm256_broadcast_ss(w + r * w_stride);
    for (int c = 0; c < kCols; ++c) {
      float* out = scores + r * kTile + c * 8;
      _mm256_storeu_ps(out,
                       _mm256_fmadd_ps(wb, _mm256_max_ps(zero, acc[r][c]), _mm256_loadu_ps(out)));
    }
  }
}

void score_tile(const ScoreTileArgs& args) {
  const float* query = static_cast<const float*>(args.query);
  const float* key = static_cast<const float*>(args.key);
  const int64_t depth = args.depth;
  for (int h = 0; h < args.groups; ++h) {
    const float* qh = query + h * args.row_capacity * depth;
    for (int pass = 0; pass < kTile / (8 * kCols); ++pass) {
      const int col = pass * 8 * kCols;
      for_each_even_row_block<6>(args.row_begin, args.row_end, [&](auto rows, int r) {
        score_block<decltype(rows)::value>(qh + r * depth, depth, key + col,
                                           args.weights + r * args.groups + h, args.groups,
                                           args.scores + r * kTile + col);
      });
    }
  }
}

// Up to 8 elements of a bf16 or fp16 row as float32 (exactly), zero after `count`.
inline __m256i widen8(const char* src, int64_t count, DType dtype) {
  __m128i h;
  if (count == 8) {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  } else {
    alignas(16) uint16_t part[8] = {};
    std::memcpy(part, src, 2 * count);
    h = _mm_load_si128(reinterpret_cast<const __m128i*>(part));
  }
  if (dtype == DType::kFloat16) return _mm256_castps_si256(_mm256_cvtph_ps(h));
  return _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
}

// The words of a float32 set in ymm registers (row_packing.h).
struct Avx2Words {
  static constexpr int kLanes = 8;
  using Int = __m256i;
  static Int zero() { return _mm256_setzero_si256(); }
  static Int load_words(const char* p, int64_t count) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_maskload_epi32(reinterpret_cast<const int*>(p), mask);
  }
  static Int widen(const char* p, int64_t count, DType dtype) { return widen8(p, count, dtype); }
  static void store(uint32_t* p, Int x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x); }
  static void transpose(Int (&x)[kLanes]) { transpose8(x); }
  static void narrow_f64(const double* src, float* dst) {
    _mm_storeu_ps(dst, _mm256_cvtpd_ps(_mm256_loadu_pd(src)));
  }
};
using Packing = RowPacking<Avx2Words>;

// The float32 decode kernels' vectors (f32_decode.h): 8 lanes, nothing to fold.
struct Avx2Lanes {
  static constexpr int kLanes = 8;
  using Vec = __m256;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec load(const float* x) { return _mm256_loadu_ps(x); }
  static Vec load_part(const float* x, int64_t count) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_maskload_ps(x, mask);
  }
  static Vec widen(const uint16_t* key, int64_t count) {
    return _mm256_castsi256_ps(widen8(reinterpret_cast<const char*>(key), count, DType::kBFloat16));
  }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256 fold(Vec v) { return v; }
  // value_rows (blocks of up to 4 rows; decodes of up to 8 rows: value_rows_rows): 16 columns,
  // 8 accumulators a block, stored as the GEMM's block (above) stores with alpha 1.
  static constexpr int kValueRows = 4;
  static constexpr int kValueCols = 2;
  static constexpr int kAccumulators = 8;
  // value_rows widens 16 value columns with one load (F32ValueRows::kPairs).
  static constexpr bool kWidensPairs = true;
  static void widen_pair(const uint16_t* x, Vec& even, Vec& odd) {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(-65536)));
  }
  static void interleave(Vec& even, Vec& odd) {
    // lo: columns 0-3 | 8-11, hi: 4-7 | 12-15.
    const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
    even = _mm256_insertf128_ps(lo, _mm256_castps256_ps128(hi), 1);
    odd = _mm256_insertf128_ps(hi, _mm256_extractf128_ps(lo, 1), 0);
  }
  static Vec broadcast(const float* x) { return _mm256_broadcast_ss(x); }
  static void store_sums(float* out, Vec acc, const float* scale) {
    Vec v = _mm256_mul_ps(_mm256_set1_ps(1.0f), acc);
    if (scale != nullptr) v = _mm256_fmadd_ps(_mm256_set1_ps(*scale), _mm256_loadu_ps(out), v);
    _mm256_storeu_ps(out, v);
  }
};

void key_scores(const KeyScoresArgs& a) { F32KeyScores<Avx2Lanes>::run(a); }

void value_rows(const ValueRowsArgs& a) { F32ValueRows<Avx2Lanes>::run(a); }

}  // namespace

const KernelSet& kernel_set() {
  static const KernelSet set{"avx2",
                             Isa::kAvx2,
                             Word::kFloat32,
                             1,
                             1,
                             6,
                             4,
                             nullptr,
                             nullptr,
                             &gemm,
                             &softmax,
                             &exp_rows,
                             nullptr,
                             &Packing::pack_keys,
                             &score_tile,
                             &Packing::widen,
                             row_ops(),
                             nullptr,
                             &key_scores,
                             16,
                             &Packing::pack_widened_keys,
                             &value_rows,
                             /*gemm_rows=*/nullptr,
                             /*decode_block_tiles=*/1,
                             /*value_rows_rows=*/8,
                             /*gemm_cols=*/16};
  return set;
}

}  // namespace opmesh::core::kernels::avx2
