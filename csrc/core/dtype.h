// Element types the core reads, and portable scalar conversions to float.
#pragma once

#include <cstdint>
#include <cstring>

namespace opmesh::core {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFloat64 = 3 };

const char* dtype_name(DType dtype);

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
