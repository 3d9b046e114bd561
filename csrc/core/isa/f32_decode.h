// Decode's products on bf16 cache rows read where they lie, for the float32 sets, the rows widened
// in registers: key_scores (KernelSet::key_scores: float32 query rows against key rows, one dot
// product per (row, key) along the depth) and value_rows (KernelSet::value_rows: float32
// probabilities times value rows, the float32 GEMM's sums on the values packed). Written once
// over a vector policy; AVX2 (8 lanes) and AVX-512 (16 lanes) include it with their own flags,
// and both need AVX2 for the 8-lane sums and the transpose. The anonymous namespace gives each
// translation unit its own copy.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "../kernels/kernel_set.h"
#include "../kernels/row_blocks.h"
#include "../kernels/rows_ahead.h"

namespace opmesh::core::kernels {
namespace {

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

// Lane r of the result: the sum of a[r]'s 8 lanes (a horizontal-add tree, 7 operations for 8
// sums).
inline __m256 sum_lanes8(const __m256 (&a)[8]) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

// V: the vector policy. V::Vec holds V::kLanes floats; V::zero(), V::load(x) and
// V::load_part(x, count) (zero past count) read query elements; V::widen(key, count) widens
// bf16 key elements (zero past count); V::fma(a, b, c) = a b + c; V::fold(v) adds v's 8-lane
// pieces into one __m256 (lane l: the sum of v's lanes l, l + 8, ...). For value_rows: at most
// V::kValueRows rows, V::kValueCols vectors of columns and V::kAccumulators accumulators a block,
// V::broadcast(x), and V::store_sums(out, acc, scale) storing acc (+ scale * out with a scale)
// exactly as the set's GEMM stores a block with alpha 1. With V::kWidensPairs,
// V::widen_pair(x, even, odd) widens 2 V::kLanes bf16 elements into their even and odd elements and
// V::interleave(even, odd) puts such a pair back in column order (even: the first V::kLanes
// columns, odd: the next).
template <class V>
struct F32KeyScores {
  // kRows float32 query rows (from row r0) against 8 bf16 key rows: each key's V::kLanes elements
  // at a time widened in registers and multiplied into one accumulator per row, whose lanes are
  // summed per key; the 8 keys' sums are transposed into the rows' scores. Fewer than 8 rows take
  // kKeys keys at once, so that 8 independent accumulators hide the multiply-add's latency.
  template <int kRows>
  static void key_block(const KeyScoresArgs& a, int64_t r0, int64_t n0, LinesAhead& ahead) {
    using Vec = typename V::Vec;
    constexpr int kKeys = kRows >= 8 ? 1 : kRows >= 4 ? 8 / kRows : 2;
    const float* q = reinterpret_cast<const float*>(a.query) + r0 * a.ldq;
    const int64_t elements = 2 * a.depth;
    const int64_t full = elements / V::kLanes * V::kLanes;
    __m256i sums[8];
    for (int n = 0; n < 8; n += kKeys) {
      const uint16_t* key[kKeys];
      for (int i = 0; i < kKeys; ++i) {
        ahead.next();
        key[i] = reinterpret_cast<const uint16_t*>(a.keys + (n0 + n + i) * a.ldk);
      }
      Vec acc[kKeys][8];
      for (int i = 0; i < kKeys; ++i)
        for (int r = 0; r < 8; ++r) acc[i][r] = V::zero();
      for (int64_t e = 0; e < full; e += V::kLanes) {
        for (int i = 0; i < kKeys; ++i) {
          const Vec k = V::widen(key[i] + e, V::kLanes);
          for (int r = 0; r < kRows; ++r)
            acc[i][r] = V::fma(V::load(q + r * a.ldq + e), k, acc[i][r]);
        }
      }
      if (full < elements) {
        const int64_t count = elements - full;
        for (int i = 0; i < kKeys; ++i) {
          const Vec k = V::widen(key[i] + full, count);
          for (int r = 0; r < kRows; ++r) {
            acc[i][r] = V::fma(V::load_part(q + r * a.ldq + full, count), k, acc[i][r]);
          }
        }
      }
      for (int i = 0; i < kKeys; ++i) {
        __m256 folded[8];
        for (int r = 0; r < 8; ++r) folded[r] = V::fold(acc[i][r]);
        sums[n + i] =
            _mm256_castps_si256(_mm256_mul_ps(_mm256_set1_ps(a.alpha), sum_lanes8(folded)));
      }
    }
    transpose8(sums);  // sums[r]: row r's scores of the 8 keys
    for (int r = 0; r < kRows; ++r) {
      _mm256_storeu_ps(a.s + (r0 + r) * a.lds + n0, _mm256_castsi256_ps(sums[r]));
    }
  }

  static void run(const KeyScoresArgs& a) {
    const int blocks = (static_cast<int>(a.rows) + 7) / 8;
    LinesAhead ahead(a.ahead, blocks * kKeyTile);
    for_each_even_row_block<8>(0, static_cast<int>(a.rows), [&](auto rows, int r) {
      for (int64_t n0 = 0; n0 < kKeyTile; n0 += 8)
        key_block<decltype(rows)::value>(a, r, n0, ahead);
    });
  }
};

template <class V>
struct F32ValueRows {
  // Flash attention reads the value rows in place where dv is a multiple of 32: every block's
  // columns must divide it.
  static_assert(32 % (V::kValueCols * V::kLanes) == 0);

  // Vectors of columns a block of kRows rows takes: as many as keep V::kAccumulators
  // accumulators (at most V::kValueCols), so that few rows still have enough independent chains
  // to hide the multiply-add's latency and many rows still fit the registers.
  template <int kRows>
  static constexpr int kCols = std::clamp(V::kAccumulators / kRows, 1, V::kValueCols);

  // Whether a block widens its value columns two vectors at a time (V::kWidensPairs: one load of
  // 2 V::kLanes bf16 elements, the even ones shifted into place and the odd ones masked, half the
  // operations of widening each vector on its own; the sums come out with even and odd columns
  // apart and are interleaved once, at the store).
  template <int kRows>
  static constexpr bool kPairs = V::kWidensPairs && kCols<kRows> % 2 == 0;

  // o[r][e0, e0 + kCols * kLanes) for kRows rows from r0: one multiply-add chain per output over
  // the keys in order (a null row adds zeros), as the float32 GEMM sums a block over its depth
  // on the values packed, so the bits are the GEMM's.
  template <int kRows>
  static void block(const ValueRowsArgs& a, int r0, int64_t e0, LinesAhead& ahead) {
    using Vec = typename V::Vec;
    constexpr int kC = kCols<kRows>;
    const float* p = reinterpret_cast<const float*>(a.p) + r0 * a.ldp;
    Vec acc[kRows][kC];  // kPairs: acc[r][2 j] the even columns of pair j, acc[r][2 j + 1] the odd
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < kC; ++j) acc[r][j] = V::zero();
    for (int64_t i = 0; i < a.count; ++i) {
      ahead.next();
      const uint16_t* v = a.values[i];
      Vec x[kC];
      for (int j = 0; j < kC; ++j) {
        if constexpr (kPairs<kRows>) {
          if (j % 2 == 0) {
            if (v != nullptr) {
              V::widen_pair(v + e0 + j * V::kLanes, x[j], x[j + 1]);
            } else {
              x[j] = x[j + 1] = V::zero();
            }
          }
        } else {
          x[j] = v != nullptr ? V::widen(v + e0 + j * V::kLanes, V::kLanes) : V::zero();
        }
      }
      for (int r = 0; r < kRows; ++r) {
        const Vec pr = V::broadcast(p + r * a.ldp + i);
        for (int j = 0; j < kC; ++j) acc[r][j] = V::fma(pr, x[j], acc[r][j]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      float* out = a.o + (r0 + r) * a.ldo + e0;
      const float* scale = a.row_scale != nullptr ? a.row_scale + r0 + r : nullptr;
      if constexpr (kPairs<kRows>) {
        for (int j = 0; j < kC; j += 2) V::interleave(acc[r][j], acc[r][j + 1]);
      }
      for (int j = 0; j < kC; ++j) V::store_sums(out + j * V::kLanes, acc[r][j], scale);
    }
  }

  // P [rows][ldp] float32 (a.p read as floats) times the value rows, dv a multiple of 32.
  static void run(const ValueRowsArgs& a) {
    const int rows = static_cast<int>(a.rows);
    int64_t steps = 0;  // the blocks' calls of ahead.next()
    for_each_even_row_block<V::kValueRows>(0, rows, [&](auto r, int) {
      steps += a.dv / (kCols<decltype(r)::value> * V::kLanes) * a.count;
    });
    LinesAhead ahead(a.ahead, steps);
    for_each_even_row_block<V::kValueRows>(0, rows, [&](auto r, int r0) {
      constexpr int64_t kColumns = kCols<decltype(r)::value> * V::kLanes;
      for (int64_t e0 = 0; e0 < a.dv; e0 += kColumns) block<decltype(r)::value>(a, r0, e0, ahead);
    });
  }
};

}  // namespace
}  // namespace opmesh::core::kernels
