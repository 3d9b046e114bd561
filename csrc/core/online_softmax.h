// Streaming softmax statistics: a running (max, sum of exp(x - max)) pair that absorbs scores a
// block at a time, and merges with another pair. Empty state is (-inf, 0).
#pragma once

#include <cmath>
#include <limits>

namespace opmesh::core {

struct SoftmaxStats {
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.0f;
};

// max that returns NaN if either side is NaN, so a NaN score reaches both statistics.
inline float nan_max(float a, float b) {
  if (a != a) return a;
  return (b > a || b != b) ? b : a;
}

// Merges b into a: the result describes the union of both score sets.
inline SoftmaxStats merge(SoftmaxStats a, SoftmaxStats b) {
  if (b.sum == 0.0f && b.max == -std::numeric_limits<float>::infinity()) return a;
  if (a.sum == 0.0f && a.max == -std::numeric_limits<float>::infinity()) return b;
  const float m = nan_max(a.max, b.max);
  return {m, a.sum * std::exp(a.max - m) + b.sum * std::exp(b.max - m)};
}

// Absorbs scores x[0..n) into state. n == 0 leaves the state unchanged.
inline void absorb(SoftmaxStats& state, const float* x, int n) {
  if (n <= 0) return;
  float block_max = x[0];
  for (int j = 1; j < n; ++j) block_max = nan_max(block_max, x[j]);
  const float m = nan_max(state.max, block_max);
  float sum = 0.0f;
  for (int j = 0; j < n; ++j) sum += std::exp(x[j] - m);
  // state.max may be -inf (empty state): its contribution is 0, avoid exp(-inf - -inf).
  const float carried = state.sum == 0.0f ? 0.0f : state.sum * std::exp(state.max - m);
  state.max = m;
  state.sum = carried + sum;
}

}  // namespace opmesh::core
