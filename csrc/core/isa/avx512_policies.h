// Word policies of the AVX-512 micro-kernels (avx512_products.h): a 4-byte word type,
// its 16-lane register, and the multiply-accumulate. Float32Policy needs AVX-512F; Bf16PairPolicy
// (a pair of bf16 values per word, VDPBF16PS) exists only in translation units built with
// AVX-512 BF16.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace opmesh::core::kernels {

struct Float32Policy {
  using Word = float;
  using Vec = __m512;
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec broadcast(float w) { return _mm512_set1_ps(w); }
  static __m512 madd(__m512 acc, Vec x, Vec y) { return _mm512_fmadd_ps(x, y, acc); }
};

#if defined(__AVX512BF16__)
struct Bf16PairPolicy {
  using Word = uint32_t;
  using Vec = __m512bh;
  static Vec as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }
  static Vec load(const uint32_t* p) { return as_bh(_mm512_loadu_si512(p)); }
  static Vec broadcast(uint32_t w) { return as_bh(_mm512_set1_epi32(static_cast<int>(w))); }
  static __m512 madd(__m512 acc, Vec x, Vec y) { return _mm512_dpbf16_ps(acc, x, y); }
};
#endif

}  // namespace opmesh::core::kernels
