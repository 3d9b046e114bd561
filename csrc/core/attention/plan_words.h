// What the plan formats of flash_attn_metadata and sparse_flash_mla_metadata share: floats kept
// as int32 words, and the print of a length array (whether given, and a 64-bit hash of its
// values) that a call is checked against.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace opmesh::core::plan_words {

// The same bits as another type of the same size.
template <class To, class From>
To same_bits(const From& from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof(to));
  return to;
}
inline int32_t float_bits(float f) { return same_bits<int32_t>(f); }
inline float bits_float(int32_t w) { return same_bits<float>(w); }

// 64-bit hash of the values: a multiply-xorshift mix per value (word-wise FNV with a final
// avalanche), so any changed entry changes the print.
template <class T>
uint64_t hash_values(const T* values, int64_t count) {
  static_assert(std::is_integral_v<T>);
  uint64_t h = 0xcbf29ce484222325ull ^ static_cast<uint64_t>(count);
  for (int64_t i = 0; i < count; ++i) {
    h ^= static_cast<std::make_unsigned_t<T>>(values[i]);
    h *= 0x100000001b3ull;
    h ^= h >> 29;
  }
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return h;
}

// A length array as three words: given (0/1), the hash's low and high halves.
struct ArrayPrint {
  int32_t present;
  int32_t low;
  int32_t high;
};

template <class T>
ArrayPrint print_of(const T* values, int64_t count) {
  if (values == nullptr) return {0, 0, 0};
  const uint64_t h = hash_values(values, count);
  return {1, static_cast<int32_t>(h & 0xffffffffu), static_cast<int32_t>(h >> 32)};
}

}  // namespace opmesh::core::plan_words
