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
#pragma GCC unroll 16
  for (int i = 0; i < 4; ++i) {
    const __m256 lo = _mm256_castsi256_ps(x[i]), hi = _mm256_castsi256_ps(x[i + 4]);
    a[i] = _mm256_permute2f128_ps(lo, hi, 0x20);
    a[i + 4] = _mm256_permute2f128_ps(lo, hi, 0x31);
  }
  transpose4_in_lanes(a);
  transpose4_in_lanes(a + 4);
#pragma GCC unroll 16
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
  // The query rows' stride is a constant of the code wherever it can be (run): one base register
  // and offsets the instructions carry then address every row. With the stride a run-time value
  // each row takes a register, and 8 of them beside the key pointers do not fit: the compiler
  // reloads each row's address from the stack before its multiply-add, and those loads bound the
  // loop (8 rows on AVX2: 55% of FMA's peak against 77%). Rows 64, 128 or 256 floats apart are
  // read where they lie; other rows up to kPacked elements are copied kPacked apart first.
  static constexpr int64_t kPacked = 256;

  // kRows float32 query rows (q, `stride` floats apart: kStride when it is not 0) against 8 bf16
  // key rows from n0, into rows r0.. of a.s: each key's V::kLanes elements at a time widened in
  // registers and multiplied into one accumulator per (key, row), whose lanes are summed. Fewer
  // rows take more keys at once (kKeys), so that 8 accumulators hide the multiply-add's latency;
  // each query vector is loaded once for them, and one lane sum serves all 8 accumulators of a
  // step (lane i * kSlot + r: key i, row r), then the sums are rearranged into the rows' scores.
  template <int kRows, int64_t kStride>
  static void key_block(const KeyScoresArgs& a, const float* q, int64_t stride, int64_t r0,
                        int64_t n0, LinesAhead& ahead) {
    using Vec = typename V::Vec;
    constexpr int kKeys = kRows >= 5 ? 1 : kRows >= 3 ? 2 : 8 / kRows;
    constexpr int kSlot = 8 / kKeys;  // lanes of a key in a step's sums
    if constexpr (kStride > 0) stride = kStride;
    const int64_t elements = 2 * a.depth;
    const int64_t full = elements / V::kLanes * V::kLanes;
    const __m256 alpha = _mm256_set1_ps(a.alpha);
    __m256 step_sums[8 / kKeys];
#pragma GCC unroll 16
    for (int n = 0; n < 8; n += kKeys) {
      const uint16_t* key[kKeys];
#pragma GCC unroll 16
      for (int i = 0; i < kKeys; ++i) {
        ahead.next();
        key[i] = reinterpret_cast<const uint16_t*>(a.keys + (n0 + n + i) * a.ldk);
      }
      Vec acc[kKeys][kRows];
#pragma GCC unroll 16
      for (int i = 0; i < kKeys; ++i)
#pragma GCC unroll 16
        for (int r = 0; r < kRows; ++r) acc[i][r] = V::zero();
      for (int64_t e = 0; e < full; e += V::kLanes) {
        Vec k[kKeys];
#pragma GCC unroll 16
        for (int i = 0; i < kKeys; ++i) k[i] = V::widen(key[i] + e, V::kLanes);
#pragma GCC unroll 16
        for (int r = 0; r < kRows; ++r) {
          Vec x = V::load(q + r * stride + e);
          // In a register for every key: the compiler would fold a load into each multiply-add,
          // and the loads, not the multiply-adds, would then bound the loop.
          if constexpr (kKeys > 1) asm("" : "+v"(x));
#pragma GCC unroll 16
          for (int i = 0; i < kKeys; ++i) acc[i][r] = V::fma(x, k[i], acc[i][r]);
        }
      }
      if (full < elements) {
        const int64_t count = elements - full;
#pragma GCC unroll 16
        for (int i = 0; i < kKeys; ++i) {
          const Vec k = V::widen(key[i] + full, count);
#pragma GCC unroll 16
          for (int r = 0; r < kRows; ++r) {
            acc[i][r] = V::fma(V::load_part(q + r * stride + full, count), k, acc[i][r]);
          }
        }
      }
      __m256 folded[8];
      for (__m256& f : folded) f = _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int i = 0; i < kKeys; ++i)
#pragma GCC unroll 16
        for (int r = 0; r < kRows; ++r) folded[i * kSlot + r] = V::fold(acc[i][r]);
      step_sums[n / kKeys] = _mm256_mul_ps(alpha, sum_lanes8(folded));
    }
    // Row r's scores of the 8 keys: key k's sum is lane (k % kKeys) * kSlot + r of step k / kKeys.
    __m256 rows[kRows];
    if constexpr (kKeys == 8) {
      rows[0] = step_sums[0];
    } else if constexpr (kKeys == 4) {
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) {
        const __m256i lanes = _mm256_setr_epi32(r, 2 + r, 4 + r, 6 + r, r, 2 + r, 4 + r, 6 + r);
        rows[r] = _mm256_blend_ps(_mm256_permutevar8x32_ps(step_sums[0], lanes),
                                  _mm256_permutevar8x32_ps(step_sums[1], lanes), 0xF0);
      }
    } else {
      // One key per word of a transpose's input: for two keys a step, the step's sums and the
      // same with the halves exchanged (the second key's rows in the low half).
      __m256i x[8];
#pragma GCC unroll 16
      for (int n = 0; n < 8; ++n) {
        const __m256 v = step_sums[n / kKeys];
        x[n] =
            _mm256_castps_si256(kKeys == 2 && n % 2 == 1 ? _mm256_permute2f128_ps(v, v, 0x01) : v);
      }
      transpose8(x);  // x[r]: row r's scores of the 8 keys
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) rows[r] = _mm256_castsi256_ps(x[r]);
    }
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) _mm256_storeu_ps(a.s + (r0 + r) * a.lds + n0, rows[r]);
  }

  static void run(const KeyScoresArgs& a) {
    const int blocks = (static_cast<int>(a.rows) + 7) / 8;
    LinesAhead ahead(a.ahead, blocks * kKeyTile);
    const float* query = reinterpret_cast<const float*>(a.query);
    const int64_t elements = 2 * a.depth;
    alignas(64) float packed[8 * kPacked];
    for_each_even_row_block<8>(0, static_cast<int>(a.rows), [&](auto rows, int r) {
      constexpr int kRows = decltype(rows)::value;
      const float* q = query + r * a.ldq;
      auto keys = [&](auto stride, const float* rows_at, int64_t ld) {
        for (int64_t n0 = 0; n0 < kKeyTile; n0 += 8)
          key_block<kRows, decltype(stride)::value>(a, rows_at, ld, r, n0, ahead);
      };
      // The common head dims' rows are read where they lie, their stride a constant.
      if (a.ldq == 64) return keys(std::integral_constant<int64_t, 64>{}, q, a.ldq);
      if (a.ldq == 128) return keys(std::integral_constant<int64_t, 128>{}, q, a.ldq);
      if (a.ldq == 256) return keys(std::integral_constant<int64_t, 256>{}, q, a.ldq);
      if (elements > kPacked) return keys(std::integral_constant<int64_t, 0>{}, q, a.ldq);
#pragma GCC unroll 16
      for (int i = 0; i < kRows; ++i)
        std::copy(q + i * a.ldq, q + i * a.ldq + elements, packed + i * kPacked);
      keys(std::integral_constant<int64_t, kPacked>{}, packed, kPacked);
    });
  }
};

template <class V>
struct F32ValueRows {
  // The largest of 1, 2 and 4 at most n (n >= 1): the widths a block takes.
  static constexpr int floor_pow2(int n) { return n >= 4 ? 4 : n >= 2 ? 2 : 1; }

  // Vectors of columns a block of kRows rows takes: as many as keep V::kAccumulators
  // accumulators (at most V::kValueCols, a power of two), so that few rows still have enough
  // independent chains to hide the multiply-add's latency and many rows still fit the registers,
  // and so that few rows read more of each value row's cache lines in one pass over the keys.
  template <int kRows>
  static constexpr int kCols = floor_pow2(std::min(V::kAccumulators / kRows, V::kValueCols));

  // Flash attention reads the value rows in place where dv is a multiple of 32: a block wider
  // than 32 columns leaves the rest to blocks of 32 (kNarrow vectors).
  template <int kRows>
  static constexpr int kNarrow = std::min(kCols<kRows>, 32 / V::kLanes);
  static_assert(32 % V::kLanes == 0);

  // Whether a block of kC vectors widens its value columns two vectors at a time
  // (V::kWidensPairs: one load of 2 V::kLanes bf16 elements, the even ones shifted into place and
  // the odd ones masked, half the operations of widening each vector on its own; the sums come
  // out with even and odd columns apart and are interleaved once, at the store).
  template <int kC>
  static constexpr bool kPairs = V::kWidensPairs && kC % 2 == 0;

  // o[r][e0, e0 + kC * kLanes) for kRows rows from r0: one multiply-add chain per output over
  // the keys in order (a null row adds zeros), as the float32 GEMM sums a block over its depth
  // on the values packed, so the bits are the GEMM's.
  template <int kRows, int kC>
  static void block(const ValueRowsArgs& a, int r0, int64_t e0, LinesAhead& ahead) {
    using Vec = typename V::Vec;
    const float* p = reinterpret_cast<const float*>(a.p) + r0 * a.ldp;
    Vec acc[kRows][kC];  // kPairs: acc[r][2 j] the even columns of pair j, acc[r][2 j + 1] the odd
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 16
      for (int j = 0; j < kC; ++j) acc[r][j] = V::zero();
    for (int64_t i = 0; i < a.count; ++i) {
      ahead.next();
      const uint16_t* v = a.values[i];
      Vec x[kC];
#pragma GCC unroll 16
      for (int j = 0; j < kC; ++j) {
        if constexpr (kPairs<kC>) {
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
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) {
        const Vec pr = V::broadcast(p + r * a.ldp + i);
#pragma GCC unroll 16
        for (int j = 0; j < kC; ++j) acc[r][j] = V::fma(pr, x[j], acc[r][j]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      float* out = a.o + (r0 + r) * a.ldo + e0;
      const float* scale = a.row_scale != nullptr ? a.row_scale + r0 + r : nullptr;
      if constexpr (kPairs<kC>) {
#pragma GCC unroll 16
        for (int j = 0; j < kC; j += 2) V::interleave(acc[r][j], acc[r][j + 1]);
      }
#pragma GCC unroll 16
      for (int j = 0; j < kC; ++j) V::store_sums(out + j * V::kLanes, acc[r][j], scale);
    }
  }

  // P [rows][ldp] float32 (a.p read as floats) times the value rows, dv a multiple of 32.
  static void run(const ValueRowsArgs& a) {
    const int rows = static_cast<int>(a.rows);
    int64_t steps = 0;  // the blocks' calls of ahead.next()
    for_each_even_row_block<V::kValueRows>(0, rows, [&](auto r, int) {
      constexpr int64_t kWide = kCols<decltype(r)::value> * V::kLanes;
      constexpr int64_t kRest = kNarrow<decltype(r)::value> * V::kLanes;
      steps += (a.dv / kWide + a.dv % kWide / kRest) * a.count;
    });
    LinesAhead ahead(a.ahead, steps);
    for_each_even_row_block<V::kValueRows>(0, rows, [&](auto r, int r0) {
      constexpr int kRows = decltype(r)::value;
      constexpr int64_t kWide = kCols<kRows> * V::kLanes;
      constexpr int64_t kRest = kNarrow<kRows> * V::kLanes;
      int64_t e0 = 0;
      for (; e0 + kWide <= a.dv; e0 += kWide) block<kRows, kCols<kRows>>(a, r0, e0, ahead);
      for (; e0 < a.dv; e0 += kRest) block<kRows, kNarrow<kRows>>(a, r0, e0, ahead);
    });
  }
};

}  // namespace
}  // namespace opmesh::core::kernels
