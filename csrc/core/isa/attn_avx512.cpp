// AVX-512F flash-attention micro-kernels on float32 words, and the vectorised softmax step the
// bf16 variant shares.
#include <cmath>
#include <limits>

#include "avx512_gemm.h"

namespace opmesh::core::attention {
namespace {

struct Float32Policy {
  using Word = float;
  using Vec = __m512;
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec broadcast(float w) { return _mm512_set1_ps(w); }
  static __m512 madd(__m512 acc, Vec x, Vec y) { return _mm512_fmadd_ps(x, y, acc); }
};

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

void gemm_f32(const GemmArgs& g) { Avx512Gemm<Float32Policy>::run(g); }

}  // namespace

void softmax_avx512(float* s, int64_t rows, float* m, float* l, float* correction) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* x = s + r * 64;
    __m512 v[4];
    __mmask16 nan = 0;
    __m512 top = _mm512_set1_ps(m[r]);
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm512_loadu_ps(x + 16 * j);
      nan |= _mm512_cmp_ps_mask(v[j], v[j], _CMP_UNORD_Q);
      top = _mm512_max_ps(top, v[j]);
    }
    float row_max = _mm512_reduce_max_ps(top);
    if (nan != 0 || m[r] != m[r]) row_max = std::numeric_limits<float>::quiet_NaN();
    if (row_max == kNegInf) {
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(x + 16 * j, _mm512_setzero_ps());
      correction[r] = 1.0f;
      continue;
    }
    const __m512 mv = _mm512_set1_ps(row_max);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      const __m512 p = exp_nonpositive(_mm512_sub_ps(v[j], mv));
      sum = _mm512_add_ps(sum, p);
      _mm512_storeu_ps(x + 16 * j, p);
    }
    correction[r] = std::exp(m[r] - row_max);
    l[r] = l[r] * correction[r] + _mm512_reduce_add_ps(sum);
    m[r] = row_max;
  }
}

Kernels kernels_avx512() { return {&gemm_f32, &softmax_avx512, nullptr}; }

}  // namespace opmesh::core::attention
