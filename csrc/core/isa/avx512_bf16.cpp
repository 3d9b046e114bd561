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
                             &softmax_bf16};
  return set;
}

}  // namespace opmesh::core::kernels::avx512_bf16
