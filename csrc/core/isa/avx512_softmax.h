// The online-softmax step of the AVX-512 sets, written once: avx512 stores the probabilities as
// float32, avx512_bf16 rounds them to bf16 on the way out (the P.V product's operand) without a
// float32 copy. Included only by translation units compiled with AVX-512 flags.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace opmesh::core::kernels {
// An anonymous namespace: each translation unit compiles its own copy with its own flags.
namespace {

// 2^t for t <= 0: 2^n * 2^f with n = round(t), f in [-1/2, 1/2] and a degree-5 polynomial of
// 2^f fitted for least maximum relative error on that interval (below 2.4e-7 with float32
// evaluation). VREDUCEPS gives f = t - round(t) (to nearest even) in one instruction, and n = t - f
// is exact. Below 2^-126 the result is 0, never a subnormal: subnormal probabilities would send
// every product that reads them to microcode assists (measured 3.5x slower float32 causal
// attention). -inf gives 0, NaN stays NaN.
inline __m512 exp2_nonpositive(__m512 t) {
  // Not-less-than, unordered: true for NaN, false for -inf and anything below -126.
  const __mmask16 keep = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
  const __m512 f = _mm512_reduce_round_ps(t, _MM_FROUND_TO_NEAREST_INT, _MM_FROUND_NO_EXC);
  const __m512 n = _mm512_sub_ps(t, f);
  __m512 p = _mm512_set1_ps(1.327647129073739e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.675540961325169e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550713092088699e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022120237350464f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931469440460205f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

inline constexpr float kLog2e = 1.44269504088896341f;

// The softmax step of KernelSet::softmax over `rows` rows of `cols` scores, each scaled by
// `scale` (> 0) on the way in, so that m, l and the probabilities are those of scale * s;
// store(x, p0, p1) writes the 32 probabilities of columns x..x+31 of a row, p0 then p1 (to s
// itself, or to another buffer; cols is a multiple of 32). A positive scale keeps the order of the
// scores: the scaled maximum is the maximum's product, and exp(scale * s - m) is one fused
// multiply-subtract into base 2.
template <class Store>
inline void softmax_rows(float* s, int64_t rows, int64_t cols, float scale, float* m, float* l,
                         float* correction, Store store) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* x = s + r * cols;
    __mmask16 nan = 0;
    __m512 top[2] = {_mm512_set1_ps(kNegInf), _mm512_set1_ps(kNegInf)};
    for (int64_t j = 0; j < cols; j += 32) {
      for (int u = 0; u < 2; ++u) {
        const __m512 v = _mm512_loadu_ps(x + j + 16 * u);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        top[u] = _mm512_max_ps(top[u], v);
      }
    }
    float row_max = std::max(m[r], scale * _mm512_reduce_max_ps(_mm512_max_ps(top[0], top[1])));
    if (nan != 0 || m[r] != m[r]) row_max = std::numeric_limits<float>::quiet_NaN();
    if (row_max == kNegInf) {
      for (int64_t j = 0; j < cols; j += 32) store(x + j, _mm512_setzero_ps(), _mm512_setzero_ps());
      correction[r] = 1.0f;
      continue;
    }
    const __m512 a = _mm512_set1_ps(scale * kLog2e);
    const __m512 b = _mm512_set1_ps(row_max * kLog2e);
    __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t j = 0; j < cols; j += 32) {
      __m512 p[2];
      for (int u = 0; u < 2; ++u) {
        p[u] = exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(x + j + 16 * u), a, b));
        sum[u] = _mm512_add_ps(sum[u], p[u]);
      }
      store(x + j, p[0], p[1]);
    }
    correction[r] = std::exp(m[r] - row_max);
    l[r] = l[r] * correction[r] + _mm512_reduce_add_ps(_mm512_add_ps(sum[0], sum[1]));
    m[r] = row_max;
  }
}

}  // namespace
}  // namespace opmesh::core::kernels
