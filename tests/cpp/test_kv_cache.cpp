// kv_cache_write against element-wise placement, with strided rows, skipped tokens, and the slot
// checks that must refuse a bad mapping before anything is written.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "errors.h"
#include "kv_cache.h"
#include "thread_executor.h"

namespace opmesh::core {
namespace {

struct Fixture {
  static constexpr int64_t kBlocks = 3, kBlockSize = 4, kHeads = 2, kDim = 5, kTokens = 4;
  std::vector<float> key = std::vector<float>(kTokens * kHeads * kDim);
  std::vector<float> value = std::vector<float>(kTokens * kHeads * kDim);
  std::vector<float> key_cache = std::vector<float>(kBlocks * kBlockSize * kHeads * kDim, -1.0f);
  std::vector<float> value_cache = std::vector<float>(kBlocks * kBlockSize * kHeads * kDim, -1.0f);
  std::vector<int64_t> slots;

  KvCacheWriteParams params() {
    std::iota(key.begin(), key.end(), 0.0f);
    std::iota(value.begin(), value.end(), 1000.0f);
    KvCacheWriteParams p;
    p.tokens = kTokens;
    p.heads = kHeads;
    p.dim_k = p.dim_v = kDim;
    p.elem_bytes = sizeof(float);
    p.key = key.data();
    p.value = value.data();
    p.key_stride[0] = p.value_stride[0] = kHeads * kDim;
    p.key_stride[1] = p.value_stride[1] = kDim;
    p.key_stride[2] = p.value_stride[2] = 1;
    p.key_cache = key_cache.data();
    p.value_cache = value_cache.data();
    const int64_t cache_stride[4] = {kBlockSize * kHeads * kDim, kHeads * kDim, kDim, 1};
    for (int i = 0; i < 4; ++i) p.key_cache_stride[i] = p.value_cache_stride[i] = cache_stride[i];
    p.num_blocks = kBlocks;
    p.block_size = kBlockSize;
    p.slots = slots.data();
    return p;
  }
};

TEST(KvCacheWrite, PlacesEveryTokenAtItsSlotAndSkipsPadding) {
  Fixture f;
  f.slots = {11, -1, 0, 5};
  kv_cache_write(f.params(), ThreadExecutor(3));
  for (int64_t t = 0; t < Fixture::kTokens; ++t) {
    const int64_t slot = f.slots[t];
    if (slot < 0) continue;
    for (int64_t e = 0; e < Fixture::kHeads * Fixture::kDim; ++e) {
      EXPECT_EQ(f.key_cache[slot * Fixture::kHeads * Fixture::kDim + e],
                f.key[t * Fixture::kHeads * Fixture::kDim + e]);
      EXPECT_EQ(f.value_cache[slot * Fixture::kHeads * Fixture::kDim + e],
                f.value[t * Fixture::kHeads * Fixture::kDim + e]);
    }
  }
  // Slots nobody wrote keep their old contents.
  EXPECT_EQ(f.key_cache[1 * Fixture::kHeads * Fixture::kDim], -1.0f);
}

TEST(KvCacheWrite, RefusesBadMappingsBeforeWriting) {
  for (const std::vector<int64_t>& bad :
       {std::vector<int64_t>{0, 12, -1, 1}, std::vector<int64_t>{0, -2, 3, 4},
        std::vector<int64_t>{7, 1, 7, -1}}) {
    Fixture f;
    f.slots = bad;
    const std::vector<float> before = f.key_cache;
    EXPECT_THROW(kv_cache_write(f.params(), SerialExecutor()), ArgumentError);
    EXPECT_EQ(f.key_cache, before);
  }
}

}  // namespace
}  // namespace opmesh::core
