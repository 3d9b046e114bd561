#include "kv_cache.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "errors.h"

namespace opmesh::core {
namespace {

// Copies n elements of `bytes` each between strided rows (contiguous rows take memcpy).
void copy_row(const char* src, int64_t src_stride, char* dst, int64_t dst_stride, int64_t n,
              int64_t bytes) {
  if (src_stride == 1 && dst_stride == 1) {
    std::memcpy(dst, src, static_cast<size_t>(n * bytes));
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(dst + i * dst_stride * bytes, src + i * src_stride * bytes,
                static_cast<size_t>(bytes));
  }
}

// Row (token t, head h) of `src` ([token][head][dim] of `dtype`) quantized into the cache row at
// element offset `dst` of `cache`, its scale at `scale_at` of `scales`.
void quantize_into(const KvCacheWriteParams& p, const View& src, int64_t t, int64_t h, int64_t dim,
                   const MutableView& cache, int64_t dst, const MutableView& scales,
                   int64_t scale_at, float* row) {
  for (int64_t e = 0; e < dim; ++e) {
    row[e] = load_as_float(src.data, p.dtype, t * src.ss + h * src.sn + e * src.sd);
  }
  uint8_t* out = static_cast<uint8_t*>(cache.data) + dst;
  if (cache.sd == 1) {
    static_cast<float*>(scales.data)[scale_at] = quantize_row(row, dim, p.format, out);
    return;
  }
  std::vector<uint8_t> bytes(static_cast<size_t>(dim));
  static_cast<float*>(scales.data)[scale_at] = quantize_row(row, dim, p.format, bytes.data());
  for (int64_t e = 0; e < dim; ++e) out[e * cache.sd] = bytes[e];
}

}  // namespace

void check_slots(const KvCacheWriteParams& p) {
  const int64_t capacity = p.num_blocks * p.block_size;
  // (slot, token) pairs sorted by slot: O(T log T), independent of the cache's size.
  std::vector<std::pair<int64_t, int64_t>> used;
  used.reserve(static_cast<size_t>(p.tokens));
  for (int64_t t = 0; t < p.tokens; ++t) {
    const int64_t slot = p.slots[t];
    if (slot == -1) continue;
    if (slot < -1 || slot >= capacity) {
      throw ArgumentError("slot_mapping",
                          "entry " + std::to_string(t) + " is " + std::to_string(slot) +
                              ", expected -1 or a slot in [0, " + std::to_string(capacity) + ") (" +
                              std::to_string(p.num_blocks) + " blocks of " +
                              std::to_string(p.block_size) + ")");
    }
    used.emplace_back(slot, t);
  }
  std::sort(used.begin(), used.end());
  for (size_t i = 1; i < used.size(); ++i) {
    if (used[i].first == used[i - 1].first) {
      throw ArgumentError("slot_mapping", "slot " + std::to_string(used[i].first) +
                                              " is written by tokens " +
                                              std::to_string(used[i - 1].second) + " and " +
                                              std::to_string(used[i].second));
    }
  }
}

void kv_cache_write(const KvCacheWriteParams& p, const Executor& executor) {
  check_slots(p);
  const char* key = static_cast<const char*>(p.key.data);
  const char* value = static_cast<const char*>(p.value.data);
  char* key_cache = static_cast<char*>(p.key_cache.data);
  char* value_cache = static_cast<char*>(p.value_cache.data);
  const int64_t b = p.elem_bytes;
  if (p.format != CacheFormat::kPlain) {
    if (p.tokens > 0 && p.key_scale.data == nullptr) throw ArgumentError("key_scale", "is null");
    if (p.tokens > 0 && p.value_cache.data != nullptr && p.value_scale.data == nullptr) {
      throw ArgumentError("value_scale", "is null");
    }
    // One float32 row per worker, reused for every row it quantizes.
    std::vector<std::vector<float>> rows(static_cast<size_t>(executor.num_workers()));
    run_dynamic(executor, p.tokens, [&](int64_t t, int worker) {
      const int64_t slot = p.slots[t];
      if (slot < 0) return;
      const int64_t block = slot / p.block_size, offset = slot % p.block_size;
      std::vector<float>& row = rows[worker];
      row.resize(static_cast<size_t>(std::max(p.dim_k, p.dim_v)));
      for (int64_t h = 0; h < p.heads; ++h) {
        const auto at = [&](const auto& view) {
          return block * view.sb + offset * view.ss + h * view.sn;
        };
        quantize_into(p, p.key, t, h, p.dim_k, p.key_cache, at(p.key_cache), p.key_scale,
                      at(p.key_scale), row.data());
        if (p.value_cache.data == nullptr) continue;
        quantize_into(p, p.value, t, h, p.dim_v, p.value_cache, at(p.value_cache), p.value_scale,
                      at(p.value_scale), row.data());
      }
    });
    return;
  }
  run_dynamic(executor, p.tokens, [&](int64_t t, int) {
    const int64_t slot = p.slots[t];
    if (slot < 0) return;
    const int64_t block = slot / p.block_size, offset = slot % p.block_size;
    for (int64_t h = 0; h < p.heads; ++h) {
      const int64_t ks = t * p.key.ss + h * p.key.sn;
      const int64_t kd = block * p.key_cache.sb + offset * p.key_cache.ss + h * p.key_cache.sn;
      copy_row(key + ks * b, p.key.sd, key_cache + kd * b, p.key_cache.sd, p.dim_k, b);
      if (value_cache == nullptr) continue;
      const int64_t vs = t * p.value.ss + h * p.value.sn;
      const int64_t vd =
          block * p.value_cache.sb + offset * p.value_cache.ss + h * p.value_cache.sn;
      copy_row(value + vs * b, p.value.sd, value_cache + vd * b, p.value_cache.sd, p.dim_v, b);
    }
  });
}

}  // namespace opmesh::core
