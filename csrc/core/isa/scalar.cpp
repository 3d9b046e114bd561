// The portable kernel set: plain loops the compiler may vectorise for the baseline target,
// std::exp. Runs anywhere; the reference the vector sets are tested against.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "../kernels/kernel_set.h"
#include "../kernels/row_loads.h"
#include "../online_softmax.h"
#include "row_ops.h"
#include "sets.h"

namespace opmesh::core::kernels::scalar {
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

// exp(x) for x <= 0, with results below float32's smallest normal flushed to 0 as the vector
// sets flush them (subnormal probabilities would slow every product that reads them).
inline float exp_flushed(float x) {
  const float y = std::exp(x);
  return y < std::numeric_limits<float>::min() ? 0.0f : y;
}

void softmax(float* s, int64_t rows, int64_t cols, float* m, float* l, float* correction) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* x = s + r * cols;
    float top = m[r];
    for (int64_t j = 0; j < cols; ++j) top = nan_max(top, x[j]);
    if (top == kNegInf) {
      for (int64_t j = 0; j < cols; ++j) x[j] = 0.0f;
      correction[r] = 1.0f;
      continue;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < cols; ++j) {
      x[j] = exp_flushed(x[j] - top);
      sum += x[j];
    }
    correction[r] = std::exp(m[r] - top);
    l[r] = l[r] * correction[r] + sum;
    m[r] = top;
  }
}

void exp_rows(float* s, int64_t rows, int64_t cols, const float* shift) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) s[r * cols + c] = exp_flushed(s[r * cols + c] - shift[r]);
  }
}

void score_tile(const ScoreTileArgs& args) {
  const float* query = static_cast<const float*>(args.query);
  const float* key = static_cast<const float*>(args.key);
  float dot[kKeyTile];
  for (int h = 0; h < args.groups; ++h) {
    for (int r = args.row_begin; r < args.row_end; ++r) {
      const float* q = query + (h * args.row_capacity + r) * args.depth;
      std::fill(dot, dot + kKeyTile, 0.0f);
      for (int64_t d = 0; d < args.depth; ++d) {
        const float qd = q[d];
        const float* k = key + d * kKeyTile;
        for (int j = 0; j < kKeyTile; ++j) dot[j] += qd * k[j];
      }
      const float w = args.weights[r * args.groups + h];
      float* out = args.scores + r * kKeyTile;
      for (int j = 0; j < kKeyTile; ++j) out[j] += w * std::max(dot[j], 0.0f);
    }
  }
}

}  // namespace

void widen(const void* src, DType dtype, int64_t n, float* dst) {
  load_row(src, dtype, 0, 1, n, dst);
}

void pack_keys(const char* const* rows, int64_t valid, int64_t words, uint32_t* kp) {
  for (int64_t n = 0; n < kKeyTile; ++n) {
    for (int64_t d = 0; d < words; ++d) {
      uint32_t word = 0;
      if (n < valid) std::memcpy(&word, rows[n] + 4 * d, 4);
      kp[d * kKeyTile + n] = word;
    }
  }
}

void pack_widened_keys(const char* const* rows, int64_t valid, DType dtype, int64_t n,
                       const RowsAhead& ahead, uint32_t* kp) {
  LinesAhead lines(ahead, kKeyTile);
  const int64_t elem = dtype_size(dtype);
  constexpr int64_t kChunk = 64;
  float chunk[kChunk];
  for (int64_t r = 0; r < kKeyTile; ++r) {
    lines.next();
    for (int64_t d0 = 0; d0 < n; d0 += kChunk) {
      const int64_t count = std::min(kChunk, n - d0);
      if (r < valid) {
        widen(rows[r] + d0 * elem, dtype, count, chunk);
      } else {
        std::fill(chunk, chunk + count, 0.0f);
      }
      for (int64_t d = 0; d < count; ++d) std::memcpy(kp + (d0 + d) * kKeyTile + r, chunk + d, 4);
    }
  }
}

const KernelSet& kernel_set() {
  static const KernelSet set{
      "scalar",    Isa::kScalar, Word::kFloat32, 1,        1,         1,       1,
      nullptr,     nullptr,      &gemm,          &softmax, &exp_rows, nullptr, &pack_keys,
      &score_tile, &widen,       row_ops(),      nullptr,  nullptr,   0,       &pack_widened_keys};
  return set;
}

}  // namespace opmesh::core::kernels::scalar
