// The AVX-512 BF16 kernel set: VDPBF16PS on bf16 pairs for both attention products (Q.K^T on
// pairs along head_dim, P.V on pairs along keys) and for the indexer's scores, each word holding
// the pair (x[2l], x[2l+1]) multiplied exactly and accumulated in float32; VCVTNEPS2BF16 rounds P
// to bf16. Softmax and key packing are the avx512 set's.
#include "avx512_gemm.h"
#include "avx512_policies.h"
#include "avx512_softmax.h"
#include "avx512_tile.h"
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

// Each (row, key) dot product along the depth in one accumulator, then 16 accumulators' lanes
// summed at once. Every lane does useful work, where the GEMM on keys as rows fills 16 query
// columns of which a decode uses `rows`. Rows go two at a time against 8 keys (two_rows); an odd
// last row takes 16 keys at a time.
void key_scores(const KeyScoresArgs& a) {
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
                             1,
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
                             8};
  return set;
}

}  // namespace opmesh::core::kernels::avx512_bf16
