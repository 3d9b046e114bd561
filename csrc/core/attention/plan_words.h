// What the plan formats of flash_attn_metadata and sparse_flash_mla_metadata share: their first
// four words, floats kept as int32 words, and the print of a length array (whether given, and a
// 64-bit hash of its values) that a call is checked against.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
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

// The four words each format starts with: a magic word naming it, its version, the plan's size
// in words and its worker count.
enum HeaderWord : int { kMagicWord = 0, kVersionWord, kTotalWords, kWorkerWord, kHeaderStart };

inline void put_header(int32_t* words, int32_t magic, int32_t version, int64_t total,
                       int64_t workers) {
  words[kMagicWord] = magic;
  words[kVersionWord] = version;
  words[kTotalWords] = static_cast<int32_t>(total);
  words[kWorkerWord] = static_cast<int32_t>(workers);
}

// The worker count of a plan of `size` words, once its first words match the format: the magic
// word, the version, and a size that size_words(workers) gives for 1 to 65536 workers (header:
// the format's header words). corrupt(what) throws.
template <class SizeWords, class Corrupt>
int64_t header_workers(const int32_t* words, int64_t size, int64_t header, int32_t magic,
                       int32_t version, SizeWords size_words, Corrupt corrupt) {
  if (size < header) corrupt("shorter than the header");
  if (words[kMagicWord] != magic) corrupt("bad magic number");
  if (words[kVersionWord] != version) {
    corrupt("version " + std::to_string(words[kVersionWord]) + ", expected " +
            std::to_string(version));
  }
  const int64_t count = words[kWorkerWord];
  if (count < 1 || count > (1 << 16) || words[kTotalWords] != size || size_words(count) != size) {
    corrupt("its size does not match its worker count");
  }
  return count;
}

}  // namespace opmesh::core::plan_words
