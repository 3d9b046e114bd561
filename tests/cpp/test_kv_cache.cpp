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
    const int64_t cache_stride[4] = {kBlockSize * kHeads * kDim, kHeads * kDim, kDim, 1};
    p.key = core::View{key.data(), 0, kHeads * kDim, kDim, 1};
    p.value = core::View{value.data(), 0, kHeads * kDim, kDim, 1};
    p.key_cache = core::MutableView{key_cache.data(), cache_stride[0], cache_stride[1],
                                    cache_stride[2], cache_stride[3]};
    p.value_cache = core::MutableView{value_cache.data(), cache_stride[0], cache_stride[1],
                                      cache_stride[2], cache_stride[3]};
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
