// Gathers one strided row of a tensor into a packed buffer, converting to the kernels' word type.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../dtype.h"
#include "kernel_set.h"

namespace opmesh::core {

// Converts n elements spaced `stride` apart, starting at element `offset`, to float.
inline void load_row(const void* base, DType dtype, int64_t offset, int64_t stride, int64_t n,
                     float* out) {
  switch (dtype) {
    case DType::kFloat32: {
      const float* src = static_cast<const float*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = src[i * stride];
      return;
    }
    case DType::kBFloat16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits_to_float(src[i * stride]);
      return;
    }
    case DType::kFloat16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = fp16_bits_to_float(src[i * stride]);
      return;
    }
    case DType::kFloat64: {
      const double* src = static_cast<const double*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(src[i * stride]);
      return;
    }
  }
}

// Whether any of n elements spaced `stride` apart from element `offset` is a NaN or an infinity,
// read from the bits (an exponent of all ones), so that a scan runs at the speed of memory.
inline bool row_non_finite(const void* base, DType dtype, int64_t offset, int64_t stride,
                           int64_t n) {
  auto scan = [&](const auto* x, auto exponent) {
    int64_t hits = 0;
    if (stride == 1) {
      for (int64_t i = 0; i < n; ++i) hits += (x[i] & exponent) == exponent;
    } else {
      for (int64_t i = 0; i < n; ++i) hits += (x[i * stride] & exponent) == exponent;
    }
    return hits != 0;
  };
  switch (dtype) {
    case DType::kFloat32:
      return scan(static_cast<const uint32_t*>(base) + offset, uint32_t{0x7f800000u});
    case DType::kBFloat16:
      return scan(static_cast<const uint16_t*>(base) + offset, uint16_t{0x7f80u});
    case DType::kFloat16:
      return scan(static_cast<const uint16_t*>(base) + offset, uint16_t{0x7c00u});
    case DType::kFloat64:
      return scan(static_cast<const uint64_t*>(base) + offset, uint64_t{0x7ff0000000000000u});
  }
  return false;
}

// Writes scale * src[0..n) to n elements spaced `stride` apart from element `offset`, rounding
// to the destination type (round to nearest even).
inline void store_row(void* base, DType dtype, int64_t offset, int64_t stride, int64_t n,
                      const float* src, float scale) {
  switch (dtype) {
    case DType::kFloat32: {
      float* dst = static_cast<float*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i * stride] = src[i] * scale;
      return;
    }
    case DType::kBFloat16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      if (stride == 1) {  // the common case, as its own loop so that it vectorises
        for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16_bits(src[i] * scale);
        return;
      }
      for (int64_t i = 0; i < n; ++i) dst[i * stride] = float_to_bf16_bits(src[i] * scale);
      return;
    }
    case DType::kFloat16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i * stride] = float_to_fp16_bits(src[i] * scale);
      return;
    }
    case DType::kFloat64: {
      double* dst = static_cast<double*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i * stride] = static_cast<double>(src[i] * scale);
      return;
    }
  }
}

// Packs n bf16 elements into ceil(n / 2) words of (x[2l], x[2l+1]) pairs, zero-padding the last.
inline void load_row_bf16_pairs(const void* base, int64_t offset, int64_t stride, int64_t n,
                                uint32_t* out) {
  const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
  if (stride == 1) {  // little-endian words of two elements: a copy, then the odd last element
    std::memcpy(out, src, (n / 2) * sizeof(uint32_t));
    if (n % 2 != 0) out[n / 2] = src[n - 1];
    return;
  }
  for (int64_t l = 0; 2 * l < n; ++l) {
    const uint32_t lo = src[2 * l * stride];
    const uint32_t hi = 2 * l + 1 < n ? src[(2 * l + 1) * stride] : 0u;
    out[l] = lo | (hi << 16);
  }
}

// The addresses of `count` consecutive key rows from key `first`: rows[i] for key first + i.
// Rows follow each other `stride` bytes apart within a paged block of `block_size` keys (0: not
// paged, one run); `address(key)` gives the first row of each run, so a tile of keys costs one
// block-table lookup per block instead of a division per row.
template <class Address>
inline void key_row_addresses(int64_t first, int64_t count, int64_t block_size, int64_t stride,
                              Address address, const char** rows) {
  for (int64_t n = 0; n < count;) {
    const int64_t key = first + n;
    const int64_t run =
        block_size > 0 ? std::min(count - n, block_size - key % block_size) : count - n;
    const char* row = address(key);
    for (int64_t i = 0; i < run; ++i, row += stride) rows[n + i] = row;
    n += run;
  }
}

// store_row through kernel set k where the destination is a contiguous bf16 row: the set's
// conversion (RowOps::store_bf16) gives the same bits in its vector width, where this header's
// loop, compiled for the baseline instruction set, converts four values at a time.
inline void store_row(const kernels::KernelSet& k, void* base, DType dtype, int64_t offset,
                      int64_t stride, int64_t n, const float* src, float scale) {
  if (dtype == DType::kBFloat16 && stride == 1) {
    k.rows.store_bf16(src, scale, n, static_cast<uint16_t*>(base) + offset);
    return;
  }
  store_row(base, dtype, offset, stride, n, src, scale);
}

}  // namespace opmesh::core
