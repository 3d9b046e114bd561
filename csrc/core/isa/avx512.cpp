// The AVX-512F kernel set, float32 words, and the vectorised softmax step and key packing the
// bf16-pair and AMX sets share.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "avx512_policies.h"
#include "avx512_products.h"
#include "avx512_softmax.h"
#include "f32_decode.h"
#include "row_ops.h"
#include "row_packing.h"
#include "sets.h"

namespace opmesh::core::kernels::avx512 {
namespace {

void gemm(const GemmArgs& g) { Avx512Gemm<Float32Policy>::run(g); }

void score_tile(const ScoreTileArgs& args) { Avx512Tile<Float32Policy>::run(args); }

// In-register transpose of a 16 x 16 block of 4-byte words: out[c] lane i = in[i] lane c.
inline void transpose16(const __m512i in[16], __m512i out[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(in[i], in[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(in[i], in[i + 1]);
  }
  // u[4g + k], 128-bit lane l: rows 4g..4g+3 of column 4l + k.
  for (int g = 0; g < 4; ++g) {
    const __m512i* tg = t + 4 * g;
    u[4 * g + 0] = _mm512_unpacklo_epi64(tg[0], tg[2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(tg[0], tg[2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(tg[1], tg[3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(tg[1], tg[3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
    out[k] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    out[8 + k] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
    out[4 + k] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    out[12 + k] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
  }
}

// The words of a float32 set in zmm registers (row_packing.h).
struct Avx512Words {
  static constexpr int kLanes = 16;
  using Int = __m512i;
  static Int zero() { return _mm512_setzero_si512(); }
  static __mmask16 first(int64_t count) { return static_cast<__mmask16>((1u << count) - 1u); }
  static Int load_words(const char* p, int64_t count) {
    return _mm512_maskz_loadu_epi32(first(count), p);
  }
  // VCVTPH2PS for fp16, a 16-bit shift for bf16: both exact.
  static Int widen(const char* p, int64_t count, DType dtype) {
    const __m256i h = _mm256_maskz_loadu_epi16(first(count), p);
    return dtype == DType::kFloat16 ? _mm512_castps_si512(_mm512_cvtph_ps(h))
                                    : _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
  }
  static void store(uint32_t* p, Int x) { _mm512_storeu_si512(p, x); }
  static void transpose(Int (&x)[kLanes]) {
    Int out[kLanes];
    transpose16(x, out);
    std::copy(out, out + kLanes, x);
  }
  static void narrow_f64(const double* src, float* dst) {
    _mm256_storeu_ps(dst, _mm512_cvtpd_ps(_mm512_loadu_pd(src)));
  }
};
using Packing = RowPacking<Avx512Words>;

void pack_widened_keys(const char* const* rows, int64_t valid, DType dtype, int64_t n,
                       const RowsAhead& ahead, uint32_t* kp) {
  Packing::pack_widened_keys(rows, valid, dtype, n, ahead, kp);
}

}  // namespace

void pack_keys(const char* const* rows, int64_t valid, int64_t words, uint32_t* kp) {
  Packing::pack_keys(rows, valid, words, kp);
}

void widen(const void* src, DType dtype, int64_t n, float* dst) {
  Packing::widen(src, dtype, n, dst);
}

void softmax(float* s, int64_t rows, int64_t cols, float* m, float* l, float* correction) {
  softmax_rows(s, rows, cols, 1.0f, m, l, correction, [](float* x, __m512 p0, __m512 p1) {
    _mm512_storeu_ps(x, p0);
    _mm512_storeu_ps(x + 16, p1);
  });
}

void exp_rows(float* s, int64_t rows, int64_t cols, const float* shift) {
  for (int64_t r = 0; r < rows; ++r) {
    // The difference first, rounded, then base 2: the same bits as RowOps::shift_and_mask
    // followed by a zero shift, the other backward schedule's way to the same probabilities (a
    // sequence's gradients must not depend on which schedule its batch gets).
    const __m512 m = _mm512_set1_ps(shift[r]);
    const __m512 log2e = _mm512_set1_ps(kLog2e);
    for (int64_t c = 0; c < cols; c += 16) {
      float* x = s + r * cols + c;
      const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x), m);
      _mm512_storeu_ps(x, exp2_nonpositive(_mm512_mul_ps(d, log2e)));
    }
  }
}

namespace {

// The float32 decode kernels' vectors (f32_decode.h): 16 lanes, folded to 8 by adding halves.
struct Avx512Lanes {
  static constexpr int kLanes = 16;
  using Vec = __m512;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const float* x) { return _mm512_loadu_ps(x); }
  static Vec load_part(const float* x, int64_t count) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1), x);
  }
  static Vec widen(const uint16_t* key, int64_t count) {
    const __m256i h =
        count == 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key))
                    : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << count) - 1), key);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static __m256 fold(Vec v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  }
  // value_rows: up to 8 rows and 32 columns, 16 accumulators a block, stored as Avx512Gemm
  // stores one with alpha 1; 32 value columns widened from one 64-byte load (F32ValueRows::kPairs).
  static constexpr bool kWidensPairs = true;
  static void widen_pair(const uint16_t* x, Vec& even, Vec& odd) {
    const __m512i words = _mm512_loadu_si512(x);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(-65536)));
  }
  static void interleave(Vec& even, Vec& odd) {
    // even: columns 0, 2, .., 30; odd: 1, 3, .., 31 -> columns 0..15 and 16..31.
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second =
        _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const __m512 lo = _mm512_permutex2var_ps(even, first, odd);
    odd = _mm512_permutex2var_ps(even, second, odd);
    even = lo;
  }
  static constexpr int kValueRows = 8;
  // Up to 4 rows take 64 columns a pass (a value row's two cache lines in one visit).
  static constexpr int kValueCols = 4;
  static constexpr int kAccumulators = 16;
  static Vec broadcast(const float* x) { return _mm512_set1_ps(*x); }
  static void store_sums(float* out, Vec acc, const float* scale) {
    const __m512 one = _mm512_set1_ps(1.0f);
    if (scale != nullptr) {
      const __m512 old = _mm512_mul_ps(_mm512_set1_ps(*scale), _mm512_loadu_ps(out));
      _mm512_storeu_ps(out, _mm512_fmadd_ps(one, acc, old));
    } else {
      _mm512_storeu_ps(out, _mm512_mul_ps(one, acc));
    }
  }
};

void key_scores(const KeyScoresArgs& a) { F32KeyScores<Avx512Lanes>::run(a); }

void value_rows(const ValueRowsArgs& a) { F32ValueRows<Avx512Lanes>::run(a); }

}  // namespace

const KernelSet& kernel_set() {
  static const KernelSet set{
      "avx512",    Isa::kAvx512, Word::kFloat32, 1,        1,           6,       4,
      nullptr,     nullptr,      &gemm,          &softmax, &exp_rows,   nullptr, &pack_keys,
      &score_tile, &widen,       row_ops(),      nullptr,  &key_scores, 16,      &pack_widened_keys,
      &value_rows};
  return set;
}

}  // namespace opmesh::core::kernels::avx512
