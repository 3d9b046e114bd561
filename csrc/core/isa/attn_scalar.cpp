// Portable flash-attention micro-kernels: plain loops, std::exp.
#include <cmath>
#include <cstring>
#include <limits>

#include "../attention/kernels.h"
#include "../online_softmax.h"

namespace opmesh::core::attention {
namespace {

void gemm(const GemmArgs& g) {
  const float* a = static_cast<const float*>(g.a);
  const float* b = static_cast<const float*>(g.b);
  for (int64_t r = 0; r < g.m; ++r) {
    float* c = g.c + r * g.ldc;
    const float keep = g.row_scale ? g.row_scale[r] : 0.0f;
    float acc[16];
    for (int64_t col = 0; col < g.n; col += 16) {
      for (int j = 0; j < 16; ++j) acc[j] = 0.0f;
      for (int64_t d = 0; d < g.depth; ++d) {
        const float ad = a[r * g.lda + d];
        const float* bd = b + d * g.ldb + col;
        for (int j = 0; j < 16; ++j) acc[j] += ad * bd[j];
      }
      for (int j = 0; j < 16; ++j) {
        c[col + j] = g.row_scale ? keep * c[col + j] + g.alpha * acc[j] : g.alpha * acc[j];
      }
    }
  }
}

void softmax(float* s, int64_t rows, float* m, float* l, float* correction) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* x = s + r * 64;
    float top = m[r];
    for (int j = 0; j < 64; ++j) top = nan_max(top, x[j]);
    if (top == kNegInf) {
      for (int j = 0; j < 64; ++j) x[j] = 0.0f;
      correction[r] = 1.0f;
      continue;
    }
    float sum = 0.0f;
    for (int j = 0; j < 64; ++j) {
      x[j] = std::exp(x[j] - top);
      sum += x[j];
    }
    correction[r] = std::exp(m[r] - top);
    l[r] = l[r] * correction[r] + sum;
    m[r] = top;
  }
}

}  // namespace

void pack_keys_portable(const char* const* rows, int64_t valid, int64_t words, uint32_t* kp) {
  for (int64_t n = 0; n < 64; ++n) {
    for (int64_t d = 0; d < words; ++d) {
      uint32_t word = 0;
      if (n < valid) std::memcpy(&word, rows[n] + 4 * d, 4);
      kp[d * 64 + n] = word;
    }
  }
}

Kernels kernels_scalar() { return {&gemm, &softmax, nullptr, &pack_keys_portable}; }

}  // namespace opmesh::core::attention
