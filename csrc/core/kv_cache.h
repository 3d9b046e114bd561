// Writing new tokens into a paged key/value cache ([num_blocks][block_size][heads][dim]) at the
// slots slot_mapping names: slot = block * block_size + offset, -1 = skip (padding).
#pragma once

#include <cstdint>

#include "dtype.h"
#include "executor.h"
#include "vocabulary.h"

namespace opmesh::core {

struct KvCacheWriteParams {
  int64_t tokens = 0;
  int64_t heads = 0;
  int64_t dim_k = 0;
  int64_t dim_v = 0;
  int64_t elem_bytes = 0;  // plain: the same element type everywhere (checked by the caller)
  View key, value;         // [token][head][dim]: ss, sn, sd (sb 0)
  MutableView key_cache, value_cache;  // [block][offset][head][dim]
  // value and value_cache null (dim_v 0): a shared key/value cache, the key side only.
  // A quantized cache (both caches one byte per element): each (token, head) row of key and
  // value, read as float32 from `dtype`, is quantized (quantize_row in dtype.h) into the cache and
  // its scale written to key_scale / value_scale, float32 [block][offset][head] (sb, ss, sn).
  CacheFormat format = CacheFormat::kPlain;
  DType dtype = DType::kFloat32;
  MutableView key_scale, value_scale;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  const int64_t* slots = nullptr;  // [tokens]
};

// Checks every slot of `slots` (in [-1, num_blocks * block_size), no slot written twice) and
// throws ArgumentError("slot_mapping", ...) naming the first bad entry. Reads only tokens,
// num_blocks, block_size and slots.
void check_slots(const KvCacheWriteParams& params);

// check_slots, before anything is written; then copies in parallel.
void kv_cache_write(const KvCacheWriteParams& params, const Executor& executor);

}  // namespace opmesh::core
