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

// The 4 x 4 words of a[0..4) transposed within each 128-bit lane: a[i] word j <-> a[j] word i.
inline void transpose4_in_lanes(__m256* a) {
  const __m256d t0 = _mm256_castps_pd(_mm256_unpacklo_ps(a[0], a[1]));
  const __m256d t1 = _mm256_castps_pd(_mm256_unpackhi_ps(a[0], a[1]));
  const __m256d t2 = _mm256_castps_pd(_mm256_unpacklo_ps(a[2], a[3]));
  const __m256d t3 = _mm256_castps_pd(_mm256_unpackhi_ps(a[2], a[3]));
  a[0] = _mm256_castpd_ps(_mm256_unpacklo_pd(t0, t2));
  a[1] = _mm256_castpd_ps(_mm256_unpackhi_pd(t0, t2));
  a[2] = _mm256_castpd_ps(_mm256_unpacklo_pd(t1, t3));
  a[3] = _mm256_castpd_ps(_mm256_unpackhi_pd(t1, t3));
}

// The 8 x 8 words of x[0..8) transposed in place (x[i] word j <-> x[j] word i): rows i and i + 4
// exchange halves, so that a[i] holds words 0..3 of both and a[i + 4] words 4..7; then 4 x 4
// transposes within the lanes leave column c (c < 4) in a[c] and column c + 4 in a[c + 4].
inline void transpose8(__m256i (&x)[8]) {
  __m256 a[8];
  for (int i = 0; i < 4; ++i) {
    const __m256 lo = _mm256_castsi256_ps(x[i]), hi = _mm256_castsi256_ps(x[i + 4]);
    a[i] = _mm256_permute2f128_ps(lo, hi, 0x20);
    a[i + 4] = _mm256_permute2f128_ps(lo, hi, 0x31);
  }
  transpose4_in_lanes(a);
  transpose4_in_lanes(a + 4);
  for (int i = 0; i < 8; ++i) x[i] = _mm256_castps_si256(a[i]);
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

// Lane r of the result: the sum of a[r]'s 8 lanes (a horizontal-add tree, 7 operations for 8
// sums).
inline __m256 sum_lanes8(const __m256 (&a)[8]) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

// kRows float32 query rows (from row r0) against 8 bf16 key rows: each key's 8 elements at a time
// widened in registers and multiplied into one accumulator per row, whose lanes are summed per
// key; the 8 keys' sums are transposed into the rows' scores. Fewer than 8 rows take kKeys keys
// at once, so that 8 independent accumulators hide the multiply-add's latency.
template <int kRows>
void key_block(const KeyScoresArgs& a, int64_t r0, int64_t n0, LinesAhead& ahead) {
  constexpr int kKeys = kRows >= 8 ? 1 : kRows >= 4 ? 8 / kRows : 2;
  const float* q = reinterpret_cast<const float*>(a.query) + r0 * a.ldq;
  const int64_t elements = 2 * a.depth;
  const int64_t full = elements / 8 * 8;
  const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(elements - full)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i sums[8];
  for (int n = 0; n < 8; n += kKeys) {
    const char* key[kKeys];
    for (int i = 0; i < kKeys; ++i) {
      ahead.next();
      key[i] = reinterpret_cast<const char*>(a.keys + (n0 + n + i) * a.ldk);
    }
    __m256 acc[kKeys][8];
    for (int i = 0; i < kKeys; ++i)
      for (int r = 0; r < 8; ++r) acc[i][r] = _mm256_setzero_ps();
    auto step = [&](int64_t e, int64_t count, auto&& load_query) {
      for (int i = 0; i < kKeys; ++i) {
        const __m256 k = _mm256_castsi256_ps(widen8(key[i] + 2 * e, count, DType::kBFloat16));
        for (int r = 0; r < kRows; ++r) {
          acc[i][r] = _mm256_fmadd_ps(load_query(q + r * a.ldq + e), k, acc[i][r]);
        }
      }
    };
    for (int64_t e = 0; e < full; e += 8)
      step(e, 8, [](const float* x) { return _mm256_loadu_ps(x); });
    if (full < elements) {
      step(full, elements - full, [&](const float* x) { return _mm256_maskload_ps(x, tail); });
    }
    for (int i = 0; i < kKeys; ++i) {
      sums[n + i] = _mm256_castps_si256(_mm256_mul_ps(_mm256_set1_ps(a.alpha), sum_lanes8(acc[i])));
    }
  }
  transpose8(sums);  // sums[r]: row r's scores of the 8 keys
  for (int r = 0; r < kRows; ++r) {
    _mm256_storeu_ps(a.s + (r0 + r) * a.lds + n0, _mm256_castsi256_ps(sums[r]));
  }
}

void key_scores(const KeyScoresArgs& a) {
  const int blocks = (static_cast<int>(a.rows) + 7) / 8;
  LinesAhead ahead(a.ahead, blocks * kKeyTile);
  for_each_even_row_block<8>(0, static_cast<int>(a.rows), [&](auto rows, int r) {
    for (int64_t n0 = 0; n0 < kKeyTile; n0 += 8) key_block<decltype(rows)::value>(a, r, n0, ahead);
  });
}

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
                             &Packing::pack_widened_keys};
  return set;
}

}  // namespace opmesh::core::kernels::avx2
