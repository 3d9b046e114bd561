// The AVX-512 BF16 kernel set: VDPBF16PS on bf16 pairs for both attention products (Q.K^T on
// pairs along head_dim, P.V on pairs along keys) and for the indexer's scores, each word holding
// the pair (x[2l], x[2l+1]) multiplied exactly and accumulated in float32; VCVTNEPS2BF16 rounds P
// to bf16. Softmax and key packing are the avx512 set's.
#include <algorithm>
#include <cstring>

#include "avx512_policies.h"
#include "avx512_products.h"
#include "avx512_softmax.h"
#include "row_ops.h"
#include "sets.h"

namespace opmesh::core::kernels::avx512_bf16 {
namespace {

void gemm(const GemmArgs& g) { Avx512Gemm<Bf16PairPolicy>::run(g); }

void score_tile(const ScoreTileArgs& args) { Avx512Tile<Bf16PairPolicy>::run(args); }

// Accumulator i of key_scores holds key kLaneKey[i] of its 16: the tree of sum_lanes leaves the
// sum of accumulator i in lane kLaneKey[i] (the table is its own inverse).
constexpr int kLaneKey[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

// The 16 lanes of each of v[0..15] summed, four halving steps: lane kLaneKey[i] of the result is
// the sum of v[i].
__attribute__((always_inline)) inline __m512 sum_lanes(const __m512 (&v)[16]) {
  __m512 w[8];
  for (int i = 0; i < 8; ++i) {
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44),
                         _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  }
  __m512 x[4];
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88),
                         _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
  }
  __m512 y[2];
  for (int i = 0; i < 2; ++i) {
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[i], x[i + 2], 0x44),
                         _mm512_shuffle_ps(x[i], x[i + 2], 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

// Rows r and r + 1 against 8 keys: accumulator i holds (row r + kLaneKey[i] / 8, key
// kLaneKey[i] % 8), so the sum of the 16 leaves row r's 8 scores in the low lanes and row r + 1's
// in the high ones. Each key vector loaded serves both rows: 10 loads per 16 products instead of
// 17, for the same products and the same lane sums.
void two_rows(const KeyScoresArgs& a, const uint32_t* const (&key)[8], int64_t r, int64_t n0,
              int64_t full, __mmask16 tail, __m512 alpha) {
  const uint32_t* q0 = a.query + r * a.ldq;
  const uint32_t* q1 = q0 + a.ldq;
  __m512 acc[16];
  for (__m512& x : acc) x = _mm512_setzero_ps();
  auto step = [&](__m512bh x0, __m512bh x1, auto&& load_key) {
    for (int i = 0; i < 16; ++i) {
      const int row = kLaneKey[i] / 8;
      acc[i] = _mm512_dpbf16_ps(acc[i], row == 0 ? x0 : x1, load_key(key[kLaneKey[i] % 8]));
    }
  };
  for (int64_t w = 0; w < full; ++w) {
    step(Bf16PairPolicy::load(q0 + 16 * w), Bf16PairPolicy::load(q1 + 16 * w),
         [&](const uint32_t* k) { return Bf16PairPolicy::load(k + 16 * w); });
  }
  if (tail != 0) {
    const int64_t w = 16 * full;
    auto masked = [&](const uint32_t* x) {
      return Bf16PairPolicy::as_bh(_mm512_maskz_loadu_epi32(tail, x + w));
    };
    step(masked(q0), masked(q1), masked);
  }
  const __m512 sums = _mm512_mul_ps(alpha, sum_lanes(acc));
  float* s0 = a.s + r * a.lds + n0;
  _mm256_storeu_ps(s0, _mm512_castps512_ps256(sums));
  _mm256_storeu_ps(s0 + a.lds, _mm512_extractf32x8_ps(sums, 1));
}

// Rows 3 to 8 padded to kRows (4 or 8) in lane groups: lane row * kW + j (kW = 16 / kRows) of
// step s holds word s * kW + j of that row's query, so one broadcast of a key's kW words at step s
// meets every row at once and each lane accumulates its row's share of the key's dot product.
// A row's kW partial sums are then added across two accumulators at a time (log2 kW halving
// steps over 8 keys) instead of a 16-lane tree per 16 products; the 8 keys' scores leave in rows.
template <int kRows>
struct LaneGroups {
  static constexpr int kW = 16 / kRows;
  // Words the packed query holds (head dims up to 512); deeper rows take two_rows.
  static constexpr int64_t kMaxDepth = 256;

  // qb[s][row * kW + j] = word s * kW + j of query row `row`, zero past the rows and the depth:
  // 16 words of each row at a time, a transpose of kW-word blocks between the rows.
  static void pack(const KeyScoresArgs& a, uint32_t* qb) {
    for (int64_t w0 = 0; w0 < a.depth; w0 += 16) {
      const __mmask16 mask =
          static_cast<__mmask16>(a.depth - w0 >= 16 ? 0xFFFF : (1u << (a.depth - w0)) - 1);
      __m512i x[kRows];
      for (int r = 0; r < kRows; ++r) {
        x[r] = r < a.rows ? _mm512_maskz_loadu_epi32(mask, a.query + r * a.ldq + w0)
                          : _mm512_setzero_si512();
      }
      uint32_t* out = qb + w0 / kW * 16;
      if constexpr (kW == 2) {  // 8 rows x 8 two-word blocks
        __m512i t[8], u[8];
        for (int i = 0; i < 4; ++i) {
          t[2 * i] = _mm512_unpacklo_epi64(x[2 * i], x[2 * i + 1]);
          t[2 * i + 1] = _mm512_unpackhi_epi64(x[2 * i], x[2 * i + 1]);
        }
        // u[4h + 2 odd + second]: rows 4h .. 4h + 3 of blocks odd + 2 second and
        // odd + 2 second + 4 (t[2i + odd] holds the blocks of that parity of rows 2i, 2i + 1).
        for (int h = 0; h < 2; ++h) {
          for (int odd = 0; odd < 2; ++odd) {
            const __m512i lo = t[4 * h + odd], hi = t[4 * h + 2 + odd];
            u[4 * h + 2 * odd] = _mm512_shuffle_i64x2(lo, hi, 0x88);
            u[4 * h + 2 * odd + 1] = _mm512_shuffle_i64x2(lo, hi, 0xDD);
          }
        }
        for (int i = 0; i < 4; ++i) {
          const int block = (i / 2) + 2 * (i % 2);
          _mm512_storeu_si512(out + 16 * block, _mm512_shuffle_i64x2(u[i], u[4 + i], 0x88));
          _mm512_storeu_si512(out + 16 * (block + 4), _mm512_shuffle_i64x2(u[i], u[4 + i], 0xDD));
        }
      } else {  // 4 rows x 4 four-word blocks
        const __m512i t0 = _mm512_shuffle_i64x2(x[0], x[1], 0x44);
        const __m512i t1 = _mm512_shuffle_i64x2(x[0], x[1], 0xEE);
        const __m512i t2 = _mm512_shuffle_i64x2(x[2], x[3], 0x44);
        const __m512i t3 = _mm512_shuffle_i64x2(x[2], x[3], 0xEE);
        _mm512_storeu_si512(out, _mm512_shuffle_i64x2(t0, t2, 0x88));
        _mm512_storeu_si512(out + 16, _mm512_shuffle_i64x2(t0, t2, 0xDD));
        _mm512_storeu_si512(out + 32, _mm512_shuffle_i64x2(t1, t3, 0x88));
        _mm512_storeu_si512(out + 48, _mm512_shuffle_i64x2(t1, t3, 0xDD));
      }
    }
  }

  // Index vectors of store()'s permutations (entries of 16 and more pick the second source).
  struct Tables {
    alignas(64) int32_t first[2][16];   // (v[2h], v[2h + 1]) -> rows 4h .. 4h + 3, keys 0..3
    alignas(64) int32_t second[2][16];  // (X, Z) -> rows 2u, 2u + 1 of X's four, keys 0..7
    alignas(64) int32_t rows4[16];      // rows 0, 1 (or 2, 3) of the 4-row reduction
  };
  static constexpr Tables tables() {
    Tables tb{};
    for (int h = 0; h < 2; ++h) {
      for (int r = 0; r < 4; ++r) {
        for (int k = 0; k < 4; ++k) {
          const int row = 4 * h + r;
          tb.first[h][4 * r + k] = 16 * (k / 2) + 4 * (row / 2) + 2 * (k % 2) + row % 2;
        }
      }
    }
    for (int u = 0; u < 2; ++u) {
      for (int t = 0; t < 2; ++t) {
        for (int kk = 0; kk < 8; ++kk) {
          const int r = 2 * u + t;
          tb.second[u][8 * t + kk] = kk < 4 ? 4 * r + kk : 16 + 4 * r + kk - 4;
        }
      }
    }
    for (int t = 0; t < 2; ++t) {
      for (int kk = 0; kk < 8; ++kk) tb.rows4[8 * t + kk] = (kk / 4) * 8 + 4 * t + kk % 4;
    }
    return tb;
  }

  // The scores of the 8 keys from their accumulators (lane row * kW + j of acc[i]: key i's
  // partial sum j of that row), scaled, to rows [0, a.rows) of columns n0 .. n0 + 7.
  static void store(const KeyScoresArgs& a, __m512 (&acc)[8], int64_t n0, __m512 alpha) {
    static constexpr Tables kTables = tables();
    __m512 v[4];
    for (int p = 0; p < 4; ++p) {
      v[p] = _mm512_add_ps(_mm512_shuffle_ps(acc[2 * p], acc[2 * p + 1], 0x88),
                           _mm512_shuffle_ps(acc[2 * p], acc[2 * p + 1], 0xDD));
    }
    __m512 out[kRows / 2];  // out[u]: rows 2u (low half) and 2u + 1 (high half), keys 0..7
    if constexpr (kRows == 8) {
      // v[p] lane 4 (row / 2) + 2 (key % 2) + row % 2 holds (key 2p + key % 2, row).
      for (int h = 0; h < 2; ++h) {
        const __m512i first = _mm512_load_si512(kTables.first[h]);
        const __m512 x = _mm512_permutex2var_ps(v[0], first, v[1]);  // keys 0..3
        const __m512 z = _mm512_permutex2var_ps(v[2], first, v[3]);  // keys 4..7
        for (int u = 0; u < 2; ++u) {
          out[2 * h + u] = _mm512_permutex2var_ps(x, _mm512_load_si512(kTables.second[u]), z);
        }
      }
    } else {
      // v[p] lane 4 row + c: (key 2p + c / 2, half c % 2 of the row's partial sums).
      __m512 y[2];  // y[q] lane 4 row + k: key 4q + k
      for (int q = 0; q < 2; ++q) {
        y[q] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * q], v[2 * q + 1], 0x88),
                             _mm512_shuffle_ps(v[2 * q], v[2 * q + 1], 0xDD));
      }
      const __m512i rows4 = _mm512_load_si512(kTables.rows4);
      out[0] = _mm512_permutexvar_ps(rows4, _mm512_shuffle_f32x4(y[0], y[1], 0x44));
      out[1] = _mm512_permutexvar_ps(rows4, _mm512_shuffle_f32x4(y[0], y[1], 0xEE));
    }
    for (int u = 0; u < kRows / 2; ++u) {
      const __m512 scaled = _mm512_mul_ps(alpha, out[u]);
      if (2 * u < a.rows) {
        _mm256_storeu_ps(a.s + 2 * u * a.lds + n0, _mm512_castps512_ps256(scaled));
      }
      if (2 * u + 1 < a.rows) {
        _mm256_storeu_ps(a.s + (2 * u + 1) * a.lds + n0, _mm512_extractf32x8_ps(scaled, 1));
      }
    }
  }

  // The 8 keys' accumulators for 8 rows (kW = 2): each step broadcasts a key's 2 words (a load
  // alone) against the 8 rows' words of that step.
  static void two_words(const uint32_t* qb, const uint32_t* const (&key)[8], int64_t full,
                        int64_t tail, LinesAhead& ahead, __m512 (&acc)[8]) {
    auto broadcast = [](const uint32_t* p) {
      int64_t w;
      std::memcpy(&w, p, sizeof(w));
      return Bf16PairPolicy::as_bh(_mm512_set1_epi64(w));
    };
    for (__m512& x : acc) x = _mm512_setzero_ps();
    for (int64_t s0 = 0; s0 < full; s0 += 8) {
      ahead.next();
      for (int64_t s = s0; s < std::min(full, s0 + 8); ++s) {
        const __m512bh q = Bf16PairPolicy::load(qb + 16 * s);
        for (int i = 0; i < 8; ++i)
          acc[i] = _mm512_dpbf16_ps(acc[i], broadcast(key[i] + kW * s), q);
      }
    }
    if (tail != 0) {  // one word
      const __m512bh q = Bf16PairPolicy::load(qb + 16 * full);
      for (int i = 0; i < 8; ++i) {
        const __m128i x = _mm_maskz_loadu_epi32(1, key[i] + kW * full);
        acc[i] = _mm512_dpbf16_ps(acc[i], Bf16PairPolicy::as_bh(_mm512_broadcastq_epi64(x)), q);
      }
    }
  }

  // The 8 keys' accumulators for 4 rows (kW = 4) in two 256-bit halves, rows 0-1 and rows 2-3:
  // a 128-bit broadcast into 256 bits is a load alone, where into 512 bits it also takes a
  // shuffle (measured on Zen 4: 0.40 ns per 512-bit product with it, 0.31 per pair of 256-bit
  // ones). The same products in the same order as one 512-bit accumulator: the same bits.
  static void four_words(const uint32_t* qb, const uint32_t* const (&key)[8], int64_t full,
                         int64_t tail, LinesAhead& ahead, __m512 (&acc)[8]) {
    __m256 lo[8], hi[8];
    for (int i = 0; i < 8; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
    auto step = [&](int64_t s, auto&& load_key) {
      const __m256bh q0 =
          as_bh256(_mm256_load_si256(reinterpret_cast<const __m256i*>(qb + 16 * s)));
      const __m256bh q1 =
          as_bh256(_mm256_load_si256(reinterpret_cast<const __m256i*>(qb + 16 * s + 8)));
      for (int i = 0; i < 8; ++i) {
        const __m256bh k = as_bh256(load_key(key[i] + kW * s));
        lo[i] = _mm256_dpbf16_ps(lo[i], k, q0);
        hi[i] = _mm256_dpbf16_ps(hi[i], k, q1);
      }
    };
    for (int64_t s0 = 0; s0 < full; s0 += 8) {
      ahead.next();
      for (int64_t s = s0; s < std::min(full, s0 + 8); ++s) {
        step(s, [](const uint32_t* p) {
          return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        });
      }
    }
    if (tail != 0) {
      const __mmask8 mask = static_cast<__mmask8>((1u << tail) - 1);
      step(full, [mask](const uint32_t* p) {
        return _mm256_broadcastsi128_si256(_mm_maskz_loadu_epi32(mask, p));
      });
    }
    for (int i = 0; i < 8; ++i)
      acc[i] = _mm512_insertf32x8(_mm512_castps256_ps512(lo[i]), hi[i], 1);
  }

  static __m256bh as_bh256(__m256i x) { return reinterpret_cast<const __m256bh&>(x); }

  static void run(const KeyScoresArgs& a) {
    alignas(64) uint32_t qb[kMaxDepth / kW * 16];
    pack(a, qb);
    const int64_t full = a.depth / kW;
    const int64_t tail = a.depth % kW;
    const __m512 alpha = _mm512_set1_ps(a.alpha);
    LinesAhead ahead(a.ahead, (kKeyTile / 8) * ((full + 7) / 8));
    for (int64_t n0 = 0; n0 < kKeyTile; n0 += 8) {
      const uint32_t* key[8];
      for (int i = 0; i < 8; ++i) key[i] = a.keys + (n0 + i) * a.ldk;
      __m512 acc[8];
      if constexpr (kW == 2) {
        two_words(qb, key, full, tail, ahead, acc);
      } else {
        four_words(qb, key, full, tail, ahead, acc);
      }
      store(a, acc, n0, alpha);
    }
  }
};

// Each (row, key) dot product along the depth in one accumulator, then 16 accumulators' lanes
// summed at once. Every lane does useful work, where the GEMM on keys as rows fills 16 query
// columns of which a decode uses `rows`. Rows 3 to 8 go in lane groups (LaneGroups); otherwise
// rows go two at a time against 8 keys (two_rows), and an odd last row takes 16 keys at a time.
void key_scores(const KeyScoresArgs& a) {
  if (a.rows >= 3 && a.rows <= 8 && a.depth <= LaneGroups<8>::kMaxDepth) {
    if (a.rows <= 4) {
      LaneGroups<4>::run(a);
    } else {
      LaneGroups<8>::run(a);
    }
    return;
  }
  const int64_t full = a.depth / 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (a.depth % 16)) - 1);
  const __m512 alpha = _mm512_set1_ps(a.alpha);
  LinesAhead ahead(a.ahead, (kKeyTile / 16) * a.rows);  // two calls of next() per row pair
  for (int64_t n0 = 0; n0 < kKeyTile; n0 += 16) {
    for (int64_t r = 0; r + 1 < a.rows; r += 2) {
      for (int64_t half = 0; half < 16; half += 8) {
        const uint32_t* key[8];
        for (int i = 0; i < 8; ++i) key[i] = a.keys + (n0 + half + i) * a.ldk;
        ahead.next();
        two_rows(a, key, r, n0 + half, full, tail, alpha);
      }
    }
    if (a.rows % 2 == 0) continue;
    const int64_t r = a.rows - 1;
    const uint32_t* key[16];
    for (int i = 0; i < 16; ++i) key[i] = a.keys + (n0 + kLaneKey[i]) * a.ldk;
    const uint32_t* q = a.query + r * a.ldq;
    ahead.next();
    __m512 acc[16];
    for (__m512& x : acc) x = _mm512_setzero_ps();
    for (int64_t w = 0; w < full; ++w) {
      const __m512bh qv = Bf16PairPolicy::load(q + 16 * w);
      for (int i = 0; i < 16; ++i) {
        acc[i] = _mm512_dpbf16_ps(acc[i], qv, Bf16PairPolicy::load(key[i] + 16 * w));
      }
    }
    if (tail != 0) {
      const int64_t w = 16 * full;
      const __m512bh qv = Bf16PairPolicy::as_bh(_mm512_maskz_loadu_epi32(tail, q + w));
      for (int i = 0; i < 16; ++i) {
        acc[i] = _mm512_dpbf16_ps(
            acc[i], qv, Bf16PairPolicy::as_bh(_mm512_maskz_loadu_epi32(tail, key[i] + w)));
      }
    }
    _mm512_storeu_ps(a.s + r * a.lds + n0, _mm512_mul_ps(alpha, sum_lanes(acc)));
  }
}

// One pass of value_rows for kRows rows over kBlocks blocks of 32 value columns from e0: the two
// rows of a key pair loaded as they lie and interleaved in registers (VPUNPCKLWD / VPUNPCKHWD,
// within each 128-bit lane), so that lane 4L + k of a block's low accumulator sums column 8L + k
// and of its high one column 8L + 4 + k; one permutation per 16 columns puts them back in order
// before the store.
template <int kRows, int kBlocks>
__attribute__((always_inline)) inline void value_columns(const ValueRowsArgs& a, int64_t e0,
                                                         LinesAhead& ahead) {
  alignas(64) static constexpr int32_t kFirst[16] = {0, 1, 2, 3, 16, 17, 18, 19,
                                                     4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static constexpr int32_t kSecond[16] = {8,  9,  10, 11, 24, 25, 26, 27,
                                                      12, 13, 14, 15, 28, 29, 30, 31};
  const int64_t pairs = a.count / 2;
  __m512 lo[kRows][kBlocks], hi[kRows][kBlocks];
  for (int r = 0; r < kRows; ++r) {
    for (int b = 0; b < kBlocks; ++b) lo[r][b] = hi[r][b] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < pairs; ++i) {
    ahead.next();
    const uint16_t* v0 = a.values[2 * i];
    const uint16_t* v1 = a.values[2 * i + 1];
    __m512bh pl[kBlocks], ph[kBlocks];
    for (int b = 0; b < kBlocks; ++b) {
      const int64_t e = e0 + 32 * b;
      const __m512i x0 = v0 != nullptr ? _mm512_loadu_si512(v0 + e) : _mm512_setzero_si512();
      const __m512i x1 = v1 != nullptr ? _mm512_loadu_si512(v1 + e) : _mm512_setzero_si512();
      pl[b] = Bf16PairPolicy::as_bh(_mm512_unpacklo_epi16(x0, x1));
      ph[b] = Bf16PairPolicy::as_bh(_mm512_unpackhi_epi16(x0, x1));
    }
    for (int r = 0; r < kRows; ++r) {
      const __m512bh pr = Bf16PairPolicy::broadcast(a.p[r * a.ldp + i]);
      for (int b = 0; b < kBlocks; ++b) {
        lo[r][b] = _mm512_dpbf16_ps(lo[r][b], pr, pl[b]);
        hi[r][b] = _mm512_dpbf16_ps(hi[r][b], pr, ph[b]);
      }
    }
  }
  const __m512i first = _mm512_load_si512(kFirst);
  const __m512i second = _mm512_load_si512(kSecond);
  for (int r = 0; r < kRows; ++r) {
    for (int b = 0; b < kBlocks; ++b) {
      float* out = a.o + r * a.ldo + e0 + 32 * b;
      const __m512 sums[2] = {_mm512_permutex2var_ps(lo[r][b], first, hi[r][b]),
                              _mm512_permutex2var_ps(lo[r][b], second, hi[r][b])};
      for (int j = 0; j < 2; ++j) {
        // As the pair GEMM stores a block with alpha 1: sums (+ row_scale * o).
        __m512 v = sums[j];
        if (a.row_scale != nullptr) {
          v = _mm512_add_ps(
              v, _mm512_mul_ps(_mm512_set1_ps(a.row_scale[r]), _mm512_loadu_ps(out + 16 * j)));
        }
        _mm512_storeu_ps(out + 16 * j, v);
      }
    }
  }
}

// value_rows for kRows rows: as many 32-column blocks per pass over the key pairs as 16
// accumulators hold (4 for up to 2 rows, 2 for up to 4, else 1), so that few rows read each value
// row's cache lines in one visit instead of one line per pass (measured on Zen 4: 64 columns a
// pass run 4 rows' P.V 1.7x as fast as 32 when the rows come from L3). Each column's sum runs
// over the pairs in the same order whatever the blocks: the same bits.
template <int kRows>
void value_rows_for(const ValueRowsArgs& a) {
  constexpr int kBlocks = kRows <= 2 ? 4 : kRows <= 4 ? 2 : 1;
  const int64_t wide = a.dv / (32 * kBlocks) * (32 * kBlocks);
  const int64_t passes = wide / (32 * kBlocks) + (a.dv - wide) / 32;
  LinesAhead ahead(a.ahead, passes * (a.count / 2));
  int64_t e0 = 0;
  for (; e0 < wide; e0 += 32 * kBlocks) value_columns<kRows, kBlocks>(a, e0, ahead);
  for (; e0 < a.dv; e0 += 32) value_columns<kRows, 1>(a, e0, ahead);
}

void value_rows(const ValueRowsArgs& a) {
  static constexpr void (*kByRows[8])(const ValueRowsArgs&) = {
      &value_rows_for<1>, &value_rows_for<2>, &value_rows_for<3>, &value_rows_for<4>,
      &value_rows_for<5>, &value_rows_for<6>, &value_rows_for<7>, &value_rows_for<8>};
  kByRows[std::clamp<int64_t>(a.rows, 1, 8) - 1](a);
}

}  // namespace

void to_bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<const __m256i&>(h));
  }
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + i));
    _mm256_mask_storeu_epi16(dst + i, mask, reinterpret_cast<const __m256i&>(h));
  }
}

void softmax_bf16(float* s, int64_t rows, int64_t cols, float scale, float* m, float* l,
                  float* correction, uint16_t* p16) {
  // One VCVTNE2PS2BF16 rounds 32 probabilities (the same bits as two VCVTNEPS2BF16).
  softmax_rows(s, rows, cols, scale, m, l, correction, [&](float* x, __m512 p0, __m512 p1) {
    const __m512bh h = _mm512_cvtne2ps_pbh(p1, p0);
    _mm512_storeu_si512(p16 + (x - s), reinterpret_cast<const __m512i&>(h));
  });
}

const KernelSet& kernel_set() {
  static const KernelSet set{"avx512_bf16/pairs",
                             Isa::kAvx512Bf16,
                             Word::kBf16Pair,
                             1,
                             1,
                             6,
                             4,
                             nullptr,
                             nullptr,
                             &gemm,
                             &avx512::softmax,
                             &avx512::exp_rows,
                             &to_bf16,
                             &avx512::pack_keys,
                             &score_tile,
                             &avx512::widen,
                             row_ops(),
                             &softmax_bf16,
                             &key_scores,
                             8,
                             nullptr,
                             &value_rows,
                             &Avx512Gemm<Bf16PairPolicy>::run_rows};
  return set;
}

}  // namespace opmesh::core::kernels::avx512_bf16
