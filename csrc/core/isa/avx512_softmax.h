// The online-softmax step of the AVX-512 sets, written once: avx512 stores the probabilities as
// float32, avx512_bf16 rounds them to bf16 on the way out (the P.V product's operand) without a
// float32 copy. Included only by translation units compiled with AVX-512 flags.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace opmesh::core::kernels {
// An anonymous namespace: each translation unit compiles its own copy with its own flags.
namespace {

// exp(x) for x <= 0 (scores minus their running max): 2^n * 2^f with f in [-1/2, 1/2] and a
// degree-7 Taylor polynomial of 2^f (relative error below 1e-7). -inf gives 0, NaN stays NaN.
inline __m512 exp_nonpositive(__m512 x) {
  // MAXPS returns its second operand when either is NaN: (floor, x) keeps a NaN.
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The softmax step of KernelSet::softmax over `rows` rows of `cols` scores; store(x, p) writes
// the 16 probabilities p of columns x..x+15 of a row (s itself, or another buffer).
template <class Store>
inline void softmax_rows(float* s, int64_t rows, int64_t cols, float* m, float* l,
                         float* correction, Store store) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* x = s + r * cols;
    __mmask16 nan = 0;
    __m512 top[2] = {_mm512_set1_ps(m[r]), _mm512_set1_ps(m[r])};
    for (int64_t j = 0; j < cols; j += 32) {
      for (int u = 0; u < 2; ++u) {
        const __m512 v = _mm512_loadu_ps(x + j + 16 * u);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        top[u] = _mm512_max_ps(top[u], v);
      }
    }
    float row_max = _mm512_reduce_max_ps(_mm512_max_ps(top[0], top[1]));
    if (nan != 0 || m[r] != m[r]) row_max = std::numeric_limits<float>::quiet_NaN();
    if (row_max == kNegInf) {
      for (int64_t j = 0; j < cols; j += 16) store(x + j, _mm512_setzero_ps());
      correction[r] = 1.0f;
      continue;
    }
    const __m512 mv = _mm512_set1_ps(row_max);
    __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t j = 0; j < cols; j += 32) {
      for (int u = 0; u < 2; ++u) {
        const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + j + 16 * u), mv));
        sum[u] = _mm512_add_ps(sum[u], p);
        store(x + j + 16 * u, p);
      }
    }
    correction[r] = std::exp(m[r] - row_max);
    l[r] = l[r] * correction[r] + _mm512_reduce_add_ps(_mm512_add_ps(sum[0], sum[1]));
    m[r] = row_max;
  }
}

}  // namespace
}  // namespace opmesh::core::kernels
