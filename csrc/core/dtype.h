// Element types the core reads, and portable scalar conversions to float.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace opmesh::core {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFloat64 = 3 };

const char* dtype_name(DType dtype);

// Bytes per element.
inline int64_t dtype_size(DType dtype) {
  return dtype == DType::kFloat64 ? 8 : dtype == DType::kFloat32 ? 4 : 2;
}

// The bits of a binary32.
inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// IEEE binary16 -> binary32, exact for every input (normals, subnormals, inf, nan).
inline float fp16_bits_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  uint32_t wide;
  if (exponent == 0x1fu) {
    wide = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    wide = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    wide = sign;
  } else {
    // Subnormal: shift until the implicit bit appears, adjusting the exponent.
    exponent = 113u;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    wide = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// binary32 -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  // Both results, then a select (no branch, so that loops of it vectorise): a NaN is quietened,
  // anything else rounded to nearest even.
  const uint32_t quiet = (u >> 16) | 0x40u;
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

// binary32 -> binary16 bits, round to nearest even, with subnormals, overflow to inf, and NaN.
inline uint16_t float_to_fp16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;
  if (abs >= 0x47800000u)
    return sign | 0x7c00u;   // >= 65536: beyond the largest half after rounding
  if (abs >= 0x38800000u) {  // normal half
    const uint32_t mant = abs & 0x7fffffu;
    const uint32_t exp = (abs >> 23) - 112u;
    uint32_t h = (exp << 10) | (mant >> 13);
    const uint32_t rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // may carry into inf: correct
    return sign | static_cast<uint16_t>(h);
  }
  if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
  // Subnormal half: value = m * 2^-24 with m < 1024.
  const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
  const int shift = 126 - static_cast<int>(abs >> 23);  // 14..24
  uint32_t h = mant >> shift;
  const uint32_t rest = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}

// The element format of a key/value cache: the inputs' own type (plain), or one byte per element
// with one float32 scale per (token, head) row: int8 (value = q * scale, |q| <= 127) or float8
// e4m3fn (value = fp8(q) * scale, |fp8(q)| <= 448).
enum class CacheFormat : int { kPlain = 0, kInt8 = 1, kFp8E4M3 = 2 };

const char* cache_format_name(CacheFormat format);

// The largest magnitude a quantized element holds: a row's scale is its largest magnitude over it.
inline float cache_format_max(CacheFormat format) {
  return format == CacheFormat::kInt8 ? 127.0f : 448.0f;
}

// float8 e4m3fn bits -> bf16 bits, exact (every e4m3 value has at most 4 significant bits;
// subnormals m * 2^-9; 0x7f and 0xff are NaN; no infinities). Integer operations and all-ones
// masks only, no conditionals: GCC vectorises loops of it only without control flow.
inline uint16_t fp8_e4m3_bits_to_bf16_bits(uint8_t b) {
  const uint32_t x = b;
  const uint32_t e = (x >> 3) & 0xfu, m = x & 0x7u;
  const uint32_t normal = ((e + 120u) << 7) | (m << 4);
  // A subnormal m * 2^-9 with m = 2^p + r: exponent 118 + p, m's bits below its top bit.
  const uint32_t p = static_cast<uint32_t>(m >= 2) + static_cast<uint32_t>(m >= 4);
  const uint32_t sub = ((118u + p) << 7) | ((m << (7u - p)) & 0x7fu);
  const uint32_t is_sub = 0u - static_cast<uint32_t>(e == 0);
  const uint32_t is_zero = 0u - static_cast<uint32_t>((x & 0x7fu) == 0);
  const uint32_t is_nan = 0u - static_cast<uint32_t>((x & 0x7fu) == 0x7fu);
  uint32_t bits = ((normal & ~is_sub) | (sub & is_sub)) & ~is_zero;
  bits = (bits & ~is_nan) | (0x7fc0u & is_nan);
  return static_cast<uint16_t>(bits | ((x & 0x80u) << 8));
}

// float8 e4m3fn bits -> binary32, exact (through its bf16 bits).
inline float fp8_e4m3_bits_to_float(uint8_t b) {
  return bf16_bits_to_float(fp8_e4m3_bits_to_bf16_bits(b));
}

// binary32 -> float8 e4m3fn bits, round to nearest even, for |f| <= 448 (the caller clamps);
// NaN gives 0x7f.
inline uint8_t float_to_fp8_e4m3_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7f;
  if (abs >= 0x3c800000u) {  // >= 2^-6: a normal e4m3 value; the carry of the rounding is right
    const uint32_t rounded = (abs + 0x7ffffu + ((abs >> 20) & 1u)) >> 20;
    return static_cast<uint8_t>(sign | (rounded - (120u << 3)));
  }
  // Subnormal (m * 2^-9, m = 8 is the smallest normal): a * 2^9 is exact, then nearest even.
  const float a = std::fabs(f);
  return static_cast<uint8_t>(sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f)));
}

// One element of a quantized row, unscaled: the int8 value or the fp8 value as float.
inline float quantized_to_float(uint8_t b, CacheFormat format) {
  return format == CacheFormat::kInt8 ? static_cast<float>(static_cast<int8_t>(b))
                                      : fp8_e4m3_bits_to_float(b);
}

// Quantizes n floats into n bytes of `format` and returns the row's scale: amax / max (amax the
// largest magnitude), each byte the nearest (ties to even) quantized value of x / scale, clamped
// to +-max. A row of zeros has scale 0 and zero bytes; a row with a NaN or an infinity has a NaN
// scale (and zero bytes), so that every element reads back as NaN rather than as a finite lie.
inline float quantize_row(const float* x, int64_t n, CacheFormat format, uint8_t* dst) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::max(amax, std::fabs(x[i]));
  }
  const float top = cache_format_max(format);
  if (!finite || amax == 0.0f) {
    std::memset(dst, 0, static_cast<size_t>(n));
    return finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }
  const float scale = amax / top;
  for (int64_t i = 0; i < n; ++i) {
    const float y = std::clamp(x[i] / scale, -top, top);
    dst[i] = format == CacheFormat::kInt8
                 ? static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y)))
                 : float_to_fp8_e4m3_bits(y);
  }
  return scale;
}

// Reads element `index` of a buffer of `dtype` as float.
inline float load_as_float(const void* base, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(base)[index];
    case DType::kBFloat16:
      return bf16_bits_to_float(static_cast<const uint16_t*>(base)[index]);
    case DType::kFloat16:
      return fp16_bits_to_float(static_cast<const uint16_t*>(base)[index]);
    case DType::kFloat64:
      return static_cast<float>(static_cast<const double*>(base)[index]);
  }
  return 0.0f;
}

}  // namespace opmesh::core
