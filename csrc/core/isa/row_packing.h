// Row widening and key-tile packing written once over a vector policy, for the kernel sets whose
// registers hold float32 words (AVX2, AVX-512). A policy V, local to its set's translation unit:
//   static constexpr int kLanes;                                 // 4-byte words per register
//   using Int;                                                   // a register of kLanes words
//   static Int zero();
//   static Int load_words(const char* p, int64_t count);        // count <= kLanes words, 0 after
//   static Int widen(const char* p, int64_t count, DType dtype);  // bf16/fp16 -> float32 bits
//   static void store(uint32_t* p, Int x);                       // kLanes words
//   static void transpose(Int (&x)[kLanes]);                     // x[i] word j <-> x[j] word i
//   static void narrow_f64(const double* src, float* dst);       // kLanes / 2 elements
// Included only by translation units compiled with the policy's instruction-set flags; every
// function here is a template, instantiated per set.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../kernels/kernel_set.h"
#include "sets.h"

namespace opmesh::core::kernels {

template <class V>
struct RowPacking {
  static constexpr int kLanes = V::kLanes;
  using Int = typename V::Int;

  // kp[d][n] = row n's word (or widened element) d, in blocks of kLanes rows x kLanes words
  // transposed in registers; rows past `valid` are zeros. `load(row, d0, count)` gives a block
  // row's register.
  template <class Load>
  static void transpose_tile(const char* const* rows, int64_t valid, int64_t words,
                             LinesAhead& ahead, uint32_t* kp, Load&& load) {
    Int x[kLanes];
    for (int64_t n0 = 0; n0 < kKeyTile; n0 += kLanes) {
      for (int64_t d0 = 0; d0 < words; d0 += kLanes) {
        ahead.next();
        const int64_t count = std::min<int64_t>(kLanes, words - d0);
        for (int i = 0; i < kLanes; ++i) {
          x[i] = n0 + i < valid ? load(rows[n0 + i], d0, count) : V::zero();
        }
        V::transpose(x);
        for (int64_t c = 0; c < count; ++c) V::store(kp + (d0 + c) * kKeyTile + n0, x[c]);
      }
    }
  }

  static void pack_keys(const char* const* rows, int64_t valid, int64_t words, uint32_t* kp) {
    LinesAhead none({}, 0);
    transpose_tile(rows, valid, words, none, kp, [](const char* row, int64_t d0, int64_t count) {
      return V::load_words(row + 4 * d0, count);
    });
  }

  // bf16 and fp16 rows widened in registers as they are transposed; other types by the portable
  // set (float32 rows are the plain transpose).
  static void pack_widened_keys(const char* const* rows, int64_t valid, DType dtype, int64_t n,
                                const RowsAhead& ahead, uint32_t* kp) {
    if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) {
      scalar::pack_widened_keys(rows, valid, dtype, n, ahead, kp);
      return;
    }
    LinesAhead lines(ahead, (kKeyTile / kLanes) * ((n + kLanes - 1) / kLanes));
    transpose_tile(rows, valid, n, lines, kp, [dtype](const char* row, int64_t d0, int64_t count) {
      return V::widen(row + 2 * d0, count, dtype);
    });
  }

  // n elements of `dtype` to float32, exactly (float64 rounds to nearest); the tail that fills
  // no register by the portable set.
  static void widen(const void* src, DType dtype, int64_t n, float* dst) {
    int64_t i = 0;
    switch (dtype) {
      case DType::kFloat32:
        std::memcpy(dst, src, n * sizeof(float));
        return;
      case DType::kFloat16:
      case DType::kBFloat16: {
        const char* s = static_cast<const char*>(src);
        for (; i + kLanes <= n; i += kLanes) {
          V::store(reinterpret_cast<uint32_t*>(dst + i), V::widen(s + 2 * i, kLanes, dtype));
        }
        break;
      }
      case DType::kFloat64: {
        const double* s = static_cast<const double*>(src);
        for (; i + kLanes / 2 <= n; i += kLanes / 2) V::narrow_f64(s + i, dst + i);
        break;
      }
    }
    const int64_t elem = dtype == DType::kFloat64 ? 8 : 2;
    scalar::widen(static_cast<const char*>(src) + i * elem, dtype, n - i, dst + i);
  }
};

}  // namespace opmesh::core::kernels
