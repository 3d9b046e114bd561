// Micro-kernel interface of flash attention. Each instruction set implements it in its own
// translation unit (isa/attn_*.cpp), compiled with that set's flags and chosen at run time.
#pragma once

#include <cstdint>

#include "../cpu_features.h"

namespace opmesh::core::attention {

// C[m][n] = alpha * A.B, or C = row_scale[r] * C + alpha * A.B when row_scale is given.
// Operands are 4-byte words: a float per element, or a pair of bf16 elements that are consecutive
// along the depth (the layout VDPBF16PS consumes). A is row-major [m][lda]; B is packed
// [depth][ldb] with n a multiple of 16 and ldb >= n; C is float [m][ldc].
struct GemmArgs {
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  float* c;
  int64_t ldc;
  int64_t m;
  int64_t n;
  int64_t depth;
  const float* row_scale;
  float alpha;
};

// One online-softmax step over `rows` rows of 64 scores s (masked entries are -inf):
//   m_new = max(m, max_j s_j);  s_j <- exp(s_j - m_new);  correction = exp(m - m_new);
//   l <- l * correction + sum_j s_j;  m <- m_new.
// A row whose m_new is -inf (nothing visible yet) gets s = 0 and correction = 1. A NaN score
// makes the row's m, l and s NaN.
struct Kernels {
  void (*gemm)(const GemmArgs& args);
  void (*softmax)(float* s, int64_t rows, float* m, float* l, float* correction);
  // float -> bf16 with round-to-nearest-even; only set for the bf16 path.
  void (*to_bf16)(const float* src, uint16_t* dst, int64_t n);
  // Key-tile packing, a transpose of 4-byte words: kp[d][n] = word d of rows[n] for the first
  // `valid` of 64 rows, 0 for the others; `words` words per row.
  void (*pack_keys)(const char* const* rows, int64_t valid, int64_t words, uint32_t* kp);
};

void pack_keys_portable(const char* const* rows, int64_t valid, int64_t words, uint32_t* kp);

// Kernels for `isa`; with bf16_pairs the gemm consumes bf16 pairs (requires avx512_bf16).
Kernels kernels(Isa isa, bool bf16_pairs);

Kernels kernels_scalar();
#if defined(__x86_64__)
Kernels kernels_avx2();
Kernels kernels_avx512();
Kernels kernels_avx512_bf16();
#endif

}  // namespace opmesh::core::attention
