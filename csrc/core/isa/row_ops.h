// The element-wise row operations of flash attention's backward and of the KL losses (RowOps in
// kernels/kernel_set.h), written once as loops the compiler vectorises. Every kernel set's
// translation unit includes this header and so compiles the loops with its own instruction-set
// flags; the anonymous namespace gives each translation unit its own copy, so no code built for
// a newer instruction set is shared with the paths older CPUs take.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "../kernels/kernel_set.h"

namespace opmesh::core::kernels {
namespace {

constexpr int64_t kRowWidth = kKeyTile;

// s[r] <- s[r] - lse[r] where row r sees `key` (lo[r] <= key < hi[r]), -inf elsewhere.
void shift_and_mask(float* s, const float* lse, const int64_t* lo, const int64_t* hi, int64_t key) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
#pragma omp simd
  for (int64_t r = 0; r < kRowWidth; ++r) {
    const bool on = key >= lo[r] && key < hi[r];
    const float v = s[r] - lse[r];
    s[r] = on ? v : -kInf;
  }
}

// dp[r] <- p[r] (dp[r] - delta[r]).
void probability_gradient(const float* p, float* dp, const float* delta) {
#pragma omp simd
  for (int64_t r = 0; r < kRowWidth; ++r) dp[r] = p[r] * (dp[r] - delta[r]);
}

// dst[i] += src[i] for n entries.
void add_into(float* dst, const float* src, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

// dst += w relu(s).
void relu_axpy(float w, const float* s, float* dst) {
#pragma omp simd
  for (int64_t c = 0; c < kRowWidth; ++c) {
    const float v = s[c];
    const float relu = v > 0.0f ? v : 0.0f;  // selects of values only: vectorisable
    dst[c] += w * relu;
  }
}

// c1 = [s > 0] q w, c2 = [s > 0] p w; a1 += sum q relu(s), a2 += sum p relu(s).
void split_coefficients(const float* s, const float* q, const float* p, float w, float* c1,
                        float* c2, float* a1, float* a2) {
  float x1 = 0.0f, x2 = 0.0f;
#pragma omp simd reduction(+ : x1, x2)
  for (int64_t c = 0; c < kRowWidth; ++c) {
    const float v = s[c];
    const float relu = v > 0.0f ? v : 0.0f;
    const float on = v > 0.0f ? w : 0.0f;
    x1 += q[c] * relu;
    x2 += p[c] * relu;
    c1[c] = q[c] * on;
    c2[c] = p[c] * on;
  }
  *a1 += x1;
  *a2 += x2;
}

// d <- keep (d - p inv).
void target_gradient(float* d, const float* p, float inv, float keep) {
#pragma omp simd
  for (int64_t c = 0; c < kRowWidth; ++c) d[c] = keep * (d[c] - p[c] * inv);
}

// out = [s > 0] d w.
void masked_scale(const float* s, const float* d, float w, float* out) {
#pragma omp simd
  for (int64_t c = 0; c < kRowWidth; ++c) {
    const float on = s[c] > 0.0f ? w : 0.0f;
    out[c] = d[c] * on;
  }
}

// Per row r of a [rows][64] tile: z[r] += sum p, plogp[r] += sum p log p (p > 0).
void entropy_terms(const float* p, int64_t rows, double* z, double* plogp) {
  for (int64_t r = 0; r < rows; ++r) {
    float zr = 0.0f, pl = 0.0f;
    for (int64_t c = 0; c < kRowWidth; ++c) {
      const float v = p[r * kRowWidth + c];
      zr += v;
      if (v > 0.0f) pl += v * std::log(v);
    }
    z[r] += zr;
    plogp[r] += pl;
  }
}

// out[r] += sum_c a[r][c] b[r][c] for a [rows][64] pair of tiles.
void row_dots(const float* a, const float* b, int64_t rows, double* out) {
  for (int64_t r = 0; r < rows; ++r) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t c = 0; c < kRowWidth; ++c) acc += a[r * kRowWidth + c] * b[r * kRowWidth + c];
    out[r] += acc;
  }
}

// The bf16 bits of x, rounded to nearest even; a NaN stays a quiet NaN (dtype.h's rule, written
// with selects so the loops below vectorise).
inline uint32_t bf16_bits(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
}

// out[c] = bf16(a[c]) | bf16(b[c]) << 16: two rows as one row of bf16 pairs.
void pair_rows(const float* a, const float* b, uint32_t* out) {
#pragma omp simd
  for (int64_t c = 0; c < kRowWidth; ++c) out[c] = bf16_bits(a[c]) | (bf16_bits(b[c]) << 16);
}

// This translation unit's row operations.
constexpr RowOps row_ops() {
  return RowOps{
      &shift_and_mask,  &probability_gradient, &add_into,      &relu_axpy, &split_coefficients,
      &target_gradient, &masked_scale,         &entropy_terms, &row_dots,  &pair_rows};
}

}  // namespace
}  // namespace opmesh::core::kernels
