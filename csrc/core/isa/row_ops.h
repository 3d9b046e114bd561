// The element-wise row operations of flash attention and of the KL losses (RowOps in
// kernels/kernel_set.h), written once as loops the compiler vectorises. Every kernel set's
// translation unit includes this header and so compiles the loops with its own instruction-set
// flags; the anonymous namespace gives each translation unit its own copy, so no code built for
// a newer instruction set is shared with the paths older CPUs take.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "../kernels/kernel_set.h"

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

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

// out[c] = d[c] (bit `shift` of bytes[c] set ? w : 0).
void sign_scale(const uint8_t* bytes, int shift, const float* d, float w, float* out) {
#pragma omp simd
  for (int64_t c = 0; c < kRowWidth; ++c) {
    const float on = ((static_cast<uint32_t>(bytes[c]) >> shift) & 1u) != 0 ? w : 0.0f;
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

// e^x for x in [-87, 88] (clamped): 2^n e^r with |r| <= ln2 / 2 and a degree-7 Taylor polynomial
// (relative error below 1e-7), in arithmetic and selects only so the loops vectorise.
inline float exp_poly(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = __builtin_floorf(x * 1.44269504f + 0.5f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// tanh(y) = sign(y) (1 - 2 / (e^{2|y|} + 1)) for |y| >= 1/8 (|y| >= 9 is +-1 in float). Below,
// where that difference cancels (its absolute error, ~6e-8, would be all of a tiny result, and a
// large softcap multiplies it back up), the odd series to y^9, whose relative error there is
// below 1e-9.
inline float tanh_poly(float y) {
  const float a = y < 0.0f ? -y : y;
  const float big = 1.0f - 2.0f / (exp_poly(2.0f * (a < 9.0f ? a : 9.0f)) + 1.0f);
  const float a2 = a * a;
  float p = 62.0f / 2835.0f;
  p = p * a2 - 17.0f / 315.0f;
  p = p * a2 + 2.0f / 15.0f;
  p = p * a2 - 1.0f / 3.0f;
  const float small = a + a * a2 * p;
  const float t = a < 0.125f ? small : big;
  return y < 0.0f ? -t : t;
}

// The score modifications of one row of 64 scores s (already scaled): with cap > 0,
// s <- cap tanh(s / cap) and deriv <- 1 - tanh^2 (ds / d(scaled score), when deriv is given);
// then s <- s - slope |dist0 + dir c| (ALiBi, the distance of entry c).
void score_mods(float* s, float cap, float slope, int64_t dist0, int64_t dir, float* deriv) {
  if (cap > 0.0f) {
    const float inv = 1.0f / cap;
    if (deriv != nullptr) {
#pragma omp simd
      for (int64_t c = 0; c < kRowWidth; ++c) {
        const float t = tanh_poly(s[c] * inv);
        s[c] = cap * t;
        deriv[c] = 1.0f - t * t;
      }
    } else {
#pragma omp simd
      for (int64_t c = 0; c < kRowWidth; ++c) s[c] = cap * tanh_poly(s[c] * inv);
    }
  }
  if (slope != 0.0f) {
    const float d0 = static_cast<float>(dist0), step = static_cast<float>(dir);
#pragma omp simd
    for (int64_t c = 0; c < kRowWidth; ++c) {
      const float d = d0 + step * static_cast<float>(c);
      s[c] -= slope * (d < 0.0f ? -d : d);
    }
  }
}

// d[c] <- d[c] f[c].
void multiply_into(float* d, const float* f) {
#pragma omp simd
  for (int64_t c = 0; c < kRowWidth; ++c) d[c] *= f[c];
}

// out[e] = a[e] | b[e] << 16 for n entries (b null: zeros): two bf16 rows as one row of pairs.
void interleave_bf16(const uint16_t* a, const uint16_t* b, int64_t n, uint32_t* out) {
  if (b == nullptr) {
#pragma omp simd
    for (int64_t e = 0; e < n; ++e) out[e] = a[e];
    return;
  }
#pragma omp simd
  for (int64_t e = 0; e < n; ++e) out[e] = a[e] | (static_cast<uint32_t>(b[e]) << 16);
}

// x - bf16(x).
inline float residual_of(float x) {
  const uint32_t bits = bf16_bits(x) << 16;
  float hi;
  __builtin_memcpy(&hi, &bits, sizeof(hi));
  return x - hi;
}

// lo[c] = x[c] - bf16(x[c]).
void bf16_residual(const float* x, float* lo) {
#pragma omp simd
  for (int64_t c = 0; c < kRowWidth; ++c) lo[c] = residual_of(x[c]);
}

#if defined(__AVX512BW__)
// bf16_bits of 16 lanes, in the high half of each 32-bit lane (the low half zero): the rounded
// value as a float.
inline __m512i bf16_high(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), high);
  const __m512i nan = _mm512_and_si512(_mm512_or_si512(u, _mm512_set1_epi32(0x400000)), high);
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_blend_epi32(is_nan, rounded, nan);
}

// The high halves of two vectors' 32-bit lanes, a's then b's: 32 bf16 values in lane order.
inline __m512i high_halves(__m512i a, __m512i b) {
  const __m512i odd =
      _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                       25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_permutex2var_epi16(a, odd, b);
}
#endif

// One key's coefficients over n heads as bf16 pairs and their residuals' (RowOps::sign_pairs).
// The bf16 values of consecutive heads, stored as 16-bit halves in head order, are the pair words.
void sign_pairs(const uint8_t* bits, int64_t n, const float* w, float d, uint32_t* out) {
  const int64_t p = (n + 1) / 2;
  alignas(64) uint16_t hi[kRowWidth], lo[kRowWidth];
#if defined(__AVX512BW__)
  // Sixteen heads a step: their two sign bytes as a lane mask.
  const __m512 dv = _mm512_set1_ps(d);
  for (int64_t h0 = 0; h0 < n; h0 += 16) {
    const int64_t left = std::min<int64_t>(16, n - h0);
    const __mmask16 valid = static_cast<__mmask16>((1u << left) - 1u);
    const uint32_t pair = bits[h0 / 8] | (left > 8 ? uint32_t{bits[h0 / 8 + 1]} << 8 : 0u);
    const __m512 on = _mm512_maskz_loadu_ps(static_cast<__mmask16>(pair) & valid, w + h0);
    const __m512 x = _mm512_maskz_mul_ps(valid, on, dv);  // d * 0 where the bit is clear
    const __m512i high = bf16_high(x);
    const __m512i residual = bf16_high(_mm512_sub_ps(x, _mm512_castsi512_ps(high)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(hi + h0),
                       _mm512_cvtepi32_epi16(_mm512_srli_epi32(high, 16)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(lo + h0),
                       _mm512_cvtepi32_epi16(_mm512_srli_epi32(residual, 16)));
  }
#else
  for (int64_t h = 0; h < n; ++h) {
    const float x = d * (((bits[h / 8] >> (h % 8)) & 1) != 0 ? w[h] : 0.0f);
    hi[h] = static_cast<uint16_t>(bf16_bits(x));
    lo[h] = static_cast<uint16_t>(bf16_bits(residual_of(x)));
  }
#endif
  if (n % 2 != 0) hi[n] = lo[n] = 0;
  __builtin_memcpy(out, hi, p * sizeof(uint32_t));
  __builtin_memcpy(out + p, lo, p * sizeof(uint32_t));
}

// The signs selecting one key's bf16 weights, as pair words (RowOps::sign_weights): the bf16
// values of consecutive heads, stored as 16-bit halves in head order, are the pair words.
void sign_weights(const uint8_t* bits, int64_t n, const uint16_t* w, uint32_t* out) {
  uint16_t* halves = reinterpret_cast<uint16_t*>(out);
#if defined(__AVX512BW__)
  const int64_t end = n + n % 2;  // whole pairs: a zero after an odd count
  // 32 heads a step: their four sign bytes as a lane mask over the weights.
  for (int64_t h0 = 0; h0 < end; h0 += 32) {
    const int64_t left = std::min<int64_t>(32, n - h0);
    uint32_t on = 0;
    for (int64_t b = 0; b * 8 < left; ++b) on |= uint32_t{bits[h0 / 8 + b]} << (8 * b);
    if (left < 32) on &= (1u << left) - 1u;
    const int64_t width = std::min<int64_t>(32, end - h0);
    const __mmask32 lanes =
        width == 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << width) - 1u);
    _mm512_mask_storeu_epi16(halves + h0, lanes,
                             _mm512_maskz_loadu_epi16(static_cast<__mmask32>(on), w + h0));
  }
#else
  for (int64_t h = 0; h < n; ++h) halves[h] = ((bits[h / 8] >> (h % 8)) & 1) != 0 ? w[h] : 0;
  if (n % 2 != 0) halves[n] = 0;
#endif
}

// dst[i] += a src[i] for n entries.
void add_scaled(float* dst, const float* src, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] += a * src[i];
}

// One head's first-pass coefficients as bf16 halves (RowOps::coefficient_halves).
void coefficient_halves(const float* s, const float* d, float w, uint16_t* out, float* a) {
#if defined(__AVX512BW__)
  // 32 keys a step: two vectors' bf16 values and residuals, each pair packed by one permutation.
  const __m512 zero = _mm512_setzero_ps(), wv = _mm512_set1_ps(w);
  __m512 sum = zero;
  for (int64_t c = 0; c < kRowWidth; c += 32) {
    __m512i hi[2], lo[2];
    for (int k = 0; k < 2; ++k) {
      const __m512 v = _mm512_loadu_ps(s + c + 16 * k), dv = _mm512_loadu_ps(d + c + 16 * k);
      const __mmask16 on = _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ);
      sum = _mm512_add_ps(sum, _mm512_mul_ps(dv, _mm512_maskz_mov_ps(on, v)));
      const __m512 x = _mm512_mul_ps(dv, _mm512_maskz_mov_ps(on, wv));
      hi[k] = bf16_high(x);
      lo[k] = bf16_high(_mm512_sub_ps(x, _mm512_castsi512_ps(hi[k])));
    }
    _mm512_storeu_si512(out + c, high_halves(hi[0], hi[1]));
    _mm512_storeu_si512(out + kRowWidth + c, high_halves(lo[0], lo[1]));
  }
  *a += _mm512_reduce_add_ps(sum);
#else
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t c = 0; c < kRowWidth; ++c) {
    const float v = s[c];
    const float relu = v > 0.0f ? v : 0.0f;
    const float on = v > 0.0f ? w : 0.0f;
    const float x = d[c] * on;
    acc += d[c] * relu;
    out[c] = static_cast<uint16_t>(bf16_bits(x));
    out[kRowWidth + c] = static_cast<uint16_t>(bf16_bits(residual_of(x)));
  }
  *a += acc;
#endif
}

// The signs of a [heads][n] tile of scores as a word per column (RowOps::sign_words).
void sign_words(const float* s, int64_t ld, int64_t heads, int64_t n, uint64_t* out) {
#if defined(__AVX512BW__)
  // Sixteen columns a step: each row's compare mask sets bit h in the columns' two vectors of
  // eight words.
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < n; c0 += 16) {
    const int64_t left = std::min<int64_t>(16, n - c0);
    const __mmask16 valid = static_cast<__mmask16>((1u << left) - 1u);
    __m512i low = _mm512_setzero_si512(), high = _mm512_setzero_si512();
    for (int64_t h = 0; h < heads; ++h) {
      const __m512 x = _mm512_maskz_loadu_ps(valid, s + h * ld + c0);
      const __mmask16 on = _mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ);
      const __m512i bit = _mm512_set1_epi64(static_cast<long long>(uint64_t{1} << h));
      low = _mm512_mask_or_epi64(low, static_cast<__mmask8>(on), low, bit);
      high = _mm512_mask_or_epi64(high, static_cast<__mmask8>(on >> 8), high, bit);
    }
    _mm512_mask_storeu_epi64(out + c0, static_cast<__mmask8>(valid), low);
    _mm512_mask_storeu_epi64(out + c0 + 8, static_cast<__mmask8>(valid >> 8), high);
  }
#else
  for (int64_t c = 0; c < n; ++c) out[c] = 0;
  for (int64_t h = 0; h < heads; ++h) {
    const uint64_t bit = uint64_t{1} << h;
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) out[c] |= s[h * ld + c] > 0.0f ? bit : 0u;
  }
#endif
}

// dst[i] = bf16(src[i] scale).
void store_bf16(const float* src, float scale, int64_t n, uint16_t* dst) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<uint16_t>(bf16_bits(src[i] * scale));
}

int64_t first_above(const float* s, int64_t n, float limit) {
  // Whole blocks in the vector width: the first entry through as the least of their indices.
  constexpr int64_t kBlock = 32;
  int64_t c = 0;
  for (; c + kBlock <= n; c += kBlock) {
    int64_t first = kBlock;
#pragma omp simd reduction(min : first)
    for (int64_t k = 0; k < kBlock; ++k) first = std::min(first, !(s[c + k] <= limit) ? k : kBlock);
    if (first < kBlock) return c + first;
  }
  for (; c < n; ++c) {
    if (!(s[c] <= limit)) return c;
  }
  return n;
}

// One format's loop apiece, so that each vectorises (the format is the same for a whole row).
void widen_quantized_f32(const uint8_t* src, CacheFormat format, int64_t n, float* dst) {
  if (format == CacheFormat::kInt8) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(static_cast<int8_t>(src[i]));
    return;
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = fp8_e4m3_bits_to_float(src[i]);
}

// The upper half of an exact float32 is its bf16 (8 significant bits at most): no rounding.
inline uint16_t upper_half(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof(u));
  return static_cast<uint16_t>(u >> 16);
}

void widen_quantized_bf16(const uint8_t* src, CacheFormat format, int64_t n, uint16_t* dst) {
  if (format == CacheFormat::kInt8) {
#if defined(__AVX512BF16__)
    // The one row operation written with intrinsics: 32 bytes sign-extended and converted to
    // float32 in two halves, then packed to bf16 by one VCVTNE2PS2BF16 (exact: 8 significant bits
    // at most). The loop below compiles to twice the instructions (a shift and a word permutation
    // in place of the packing conversion), and the decode from an int8 cache spends its time here.
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      const __m512 lo = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
      const __m512 hi = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16))));
      _mm512_storeu_si512(dst + i, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
    src += i;
    dst += i;
    n -= i;
#endif
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      dst[i] = upper_half(static_cast<float>(static_cast<int8_t>(src[i])));
    }
    return;
  }
#if defined(__AVX512BW__)
  // With AVX-512BW, a table lookup: the bf16 bits of the 128 e4m3 magnitudes (subnormals, zero
  // and NaN included) in four registers, picked by two two-register word permutations and the
  // magnitude's bit 6, then the sign. Exact for every byte, with no second pass; the lane loop
  // below takes three times the instructions.
  static const auto table = [] {
    struct alignas(64) Table {
      uint16_t bits[128];
    } t{};
    for (int m = 0; m < 128; ++m) t.bits[m] = fp8_e4m3_bits_to_bf16_bits(static_cast<uint8_t>(m));
    return t;
  }();
  const __m512i t0 = _mm512_load_si512(table.bits), t1 = _mm512_load_si512(table.bits + 32);
  const __m512i t2 = _mm512_load_si512(table.bits + 64), t3 = _mm512_load_si512(table.bits + 96);
  const __m512i low7 = _mm512_set1_epi16(0x7f), sign = _mm512_set1_epi16(0x80);
  const __m512i upper = _mm512_set1_epi16(0x40);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i x =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    const __m512i mag = _mm512_and_si512(x, low7);
    const __m512i below = _mm512_permutex2var_epi16(t0, mag, t1);  // magnitudes 0..63
    const __m512i above = _mm512_permutex2var_epi16(t2, mag, t3);  // 64..127
    const __m512i bits = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(mag, upper), below, above);
    const __m512i signs = _mm512_slli_epi16(_mm512_and_si512(x, sign), 8);
    _mm512_storeu_si512(dst + i, _mm512_or_si512(bits, signs));
  }
  src += i;
  dst += i;
  n -= i;
#endif
  // Normal values, zeros and NaN in 16-bit lanes (a shift and an add), then the whole row again
  // through the exact conversion if it holds a subnormal (rare: below 2^-6 of a row's scale).
  uint16_t subnormal = 0;
#pragma omp simd reduction(| : subnormal)
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t x = src[i];
    const uint16_t mag = x & 0x7fu;
    const uint16_t is_zero = static_cast<uint16_t>(0u - static_cast<uint16_t>(mag == 0));
    const uint16_t is_nan = static_cast<uint16_t>(0u - static_cast<uint16_t>(mag == 0x7fu));
    const uint16_t normal = static_cast<uint16_t>((mag << 4) + (120u << 7));
    const uint16_t bits = static_cast<uint16_t>((normal & ~is_zero & ~is_nan) | (0x7fc0u & is_nan));
    dst[i] = static_cast<uint16_t>(bits | ((x & 0x80u) << 8));
    subnormal |= static_cast<uint16_t>(mag != 0 && mag < 8);
  }
  if (subnormal == 0) return;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = fp8_e4m3_bits_to_bf16_bits(src[i]);
}

void scale_bf16(uint16_t* p, const float* f, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t wide = static_cast<uint32_t>(p[i]) << 16;
    float x;
    __builtin_memcpy(&x, &wide, sizeof(x));
    p[i] = static_cast<uint16_t>(bf16_bits(x * f[i]));
  }
}

void dequantize_f32(const uint8_t* src, CacheFormat format, float scale, int64_t n, float* dst) {
  widen_quantized_f32(src, format, n, dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] *= scale;
}

void dequantize_bf16(const uint8_t* src, CacheFormat format, float scale, int64_t n,
                     uint16_t* dst) {
  widen_quantized_bf16(src, format, n, dst);  // exact, then bf16(x scale)
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t wide = static_cast<uint32_t>(dst[i]) << 16;
    float x;
    __builtin_memcpy(&x, &wide, sizeof(x));
    dst[i] = static_cast<uint16_t>(bf16_bits(x * scale));
  }
}

// This translation unit's row operations.
constexpr RowOps row_ops() {
  return RowOps{&shift_and_mask,
                &probability_gradient,
                &add_into,
                &relu_axpy,
                &split_coefficients,
                &target_gradient,
                &masked_scale,
                &sign_scale,
                &entropy_terms,
                &row_dots,
                &pair_rows,
                &score_mods,
                &multiply_into,
                &interleave_bf16,
                &bf16_residual,
                &sign_pairs,
                &sign_weights,
                &add_scaled,
                &coefficient_halves,
                &sign_words,
                &store_bf16,
                &first_above,
                &widen_quantized_f32,
                &widen_quantized_bf16,
                &scale_bf16,
                &dequantize_f32,
                &dequantize_bf16};
}

}  // namespace
}  // namespace opmesh::core::kernels
