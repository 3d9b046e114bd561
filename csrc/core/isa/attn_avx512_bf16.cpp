// AVX-512 BF16 flash-attention micro-kernels: VDPBF16PS on bf16 pairs for both products (Q.K^T on
// pairs along head_dim, P.V on pairs along keys), and VCVTNEPS2BF16 to round P to bf16.
#include "avx512_gemm.h"
#include "avx512_policies.h"

namespace opmesh::core::attention {

void softmax_avx512(float* s, int64_t rows, float* m, float* l, float* correction);
void pack_keys_avx512(const char* const* rows, int64_t valid, int64_t words, uint32_t* kp);

namespace {

void gemm_bf16(const GemmArgs& g) { Avx512Gemm<isa::Bf16PairPolicy>::run(g); }

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

}  // namespace

Kernels kernels_avx512_bf16() { return {&gemm_bf16, &softmax_avx512, &to_bf16, &pack_keys_avx512}; }

}  // namespace opmesh::core::attention
