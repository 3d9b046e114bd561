// Element types the core reads, and portable scalar conversions to float.
#pragma once

#include <cstdint>
#include <cstring>

namespace opmesh::core {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFloat64 = 3 };

const char* dtype_name(DType dtype);

// Bytes per element.
inline int64_t dtype_size(DType dtype) {
  return dtype == DType::kFloat64 ? 8 : dtype == DType::kFloat32 ? 4 : 2;
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
