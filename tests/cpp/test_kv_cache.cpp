// kv_cache_write against element-wise placement, with strided rows, skipped tokens, and the slot
// checks that must refuse a bad mapping before anything is written.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
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

// Without a value cache (one cache of rows read as key and value) only the key side is written,
// plain or quantized (no value scale needed).
TEST(KvCacheWrite, WritesOneSharedCacheFromKeyAlone) {
  Fixture f;
  f.slots = {7, 2, -1, 9};
  KvCacheWriteParams p = f.params();
  p.value = View{};
  p.value_cache = MutableView{};
  p.dim_v = 0;
  kv_cache_write(p, ThreadExecutor(2));
  const int64_t row = Fixture::kHeads * Fixture::kDim;
  for (int64_t t = 0; t < Fixture::kTokens; ++t) {
    if (f.slots[t] < 0) continue;
    for (int64_t e = 0; e < row; ++e) {
      EXPECT_EQ(f.key_cache[f.slots[t] * row + e], f.key[t * row + e]);
    }
  }
  for (float x : f.value_cache) EXPECT_EQ(x, -1.0f);  // untouched

  std::vector<uint8_t> bytes(Fixture::kBlocks * Fixture::kBlockSize * row, 0xaa);
  std::vector<float> scales(Fixture::kBlocks * Fixture::kBlockSize * Fixture::kHeads, -1.0f);
  p.format = CacheFormat::kInt8;
  p.dtype = DType::kFloat32;
  p.key_cache = MutableView{bytes.data(), Fixture::kBlockSize * row, row, Fixture::kDim, 1};
  p.key_scale =
      MutableView{scales.data(), Fixture::kBlockSize * Fixture::kHeads, Fixture::kHeads, 1, 0};
  kv_cache_write(p, ThreadExecutor(2));
  for (int64_t h = 0; h < Fixture::kHeads; ++h) {
    uint8_t want[Fixture::kDim];
    const float* src = f.key.data() + 3 * row + h * Fixture::kDim;  // token 3, slot 9
    EXPECT_EQ(scales[9 * Fixture::kHeads + h], quantize_row(src, Fixture::kDim, p.format, want));
    for (int64_t e = 0; e < Fixture::kDim; ++e) {
      EXPECT_EQ(bytes[9 * row + h * Fixture::kDim + e], want[e]);
    }
  }
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

// Every finite e4m3fn byte converts to float and back to itself; 0x7f and 0xff are NaN.
TEST(Fp8E4M3, EveryByteRoundTrips) {
  for (int b = 0; b < 256; ++b) {
    const float f = fp8_e4m3_bits_to_float(static_cast<uint8_t>(b));
    if ((b & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f)) << b;
      continue;
    }
    EXPECT_EQ(float_to_fp8_e4m3_bits(f), b) << b;
  }
  EXPECT_EQ(fp8_e4m3_bits_to_float(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_bits_to_float(0x01), 0x1p-9f);
  EXPECT_EQ(fp8_e4m3_bits_to_float(0x08), 0x1p-6f);
}

// Halfway values round to the even neighbour, in the normal and the subnormal range.
TEST(Fp8E4M3, RoundsToNearestEven) {
  EXPECT_EQ(float_to_fp8_e4m3_bits(1.0625f), 0x38);   // 1 + 1/16: between 1 and 1.125 -> 1
  EXPECT_EQ(float_to_fp8_e4m3_bits(1.1875f), 0x3a);   // between 1.125 and 1.25 -> 1.25
  EXPECT_EQ(float_to_fp8_e4m3_bits(1.07f), 0x39);     // above halfway -> 1.125
  EXPECT_EQ(float_to_fp8_e4m3_bits(0x1p-10f), 0x00);  // half the smallest subnormal -> 0
  EXPECT_EQ(float_to_fp8_e4m3_bits(3 * 0x1p-10f), 0x02);
  EXPECT_EQ(float_to_fp8_e4m3_bits(-0x1.ep-7f), 0x88);  // 15 * 2^-10: subnormal 7.5 -> 8
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::nanf("")), 0x7f);
}

TEST(QuantizeRow, ScalesByTheLargestMagnitudeAndMarksNonFiniteRows) {
  const float x[4] = {-2.0f, 0.5f, 1.5f, 0.0f};
  uint8_t q[4];
  EXPECT_EQ(quantize_row(x, 4, CacheFormat::kInt8, q), 2.0f / 127.0f);
  EXPECT_EQ(static_cast<int8_t>(q[0]), -127);
  EXPECT_EQ(static_cast<int8_t>(q[1]), 32);  // 31.75 -> 32
  EXPECT_EQ(static_cast<int8_t>(q[2]), 95);  // 95.25 -> 95
  EXPECT_EQ(q[3], 0);
  EXPECT_EQ(quantize_row(x, 4, CacheFormat::kFp8E4M3, q), 2.0f / 448.0f);
  EXPECT_EQ(q[0], 0xfe);  // -448
  const float zeros[3] = {0.0f, -0.0f, 0.0f};
  EXPECT_EQ(quantize_row(zeros, 3, CacheFormat::kInt8, q), 0.0f);
  const float bad[2] = {1.0f, std::numeric_limits<float>::infinity()};
  EXPECT_TRUE(std::isnan(quantize_row(bad, 2, CacheFormat::kFp8E4M3, q)));
  EXPECT_EQ(q[0], 0);
  EXPECT_EQ(q[1], 0);
}

// A quantized write stores each (token, head) row's bytes and scale at its slot; its key read
// from bf16 through the dtype.
TEST(KvCacheWrite, QuantizesIntoInt8AndFp8Caches) {
  for (CacheFormat format : {CacheFormat::kInt8, CacheFormat::kFp8E4M3}) {
    constexpr int64_t kBlocks = 2, kBlockSize = 3, kHeads = 2, kDim = 4;
    std::vector<uint16_t> key(2 * kHeads * kDim), value(2 * kHeads * kDim);
    for (size_t i = 0; i < key.size(); ++i) {
      key[i] = float_to_bf16_bits(static_cast<float>(i) - 5.0f);
      value[i] = float_to_bf16_bits(0.25f * static_cast<float>(i));
    }
    std::vector<uint8_t> kc(kBlocks * kBlockSize * kHeads * kDim, 0xaa), vc = kc;
    std::vector<float> ks(kBlocks * kBlockSize * kHeads, -1.0f), vs = ks;
    std::vector<int64_t> slots = {4, -1};
    KvCacheWriteParams p;
    p.tokens = 2;
    p.heads = kHeads;
    p.dim_k = p.dim_v = kDim;
    p.format = format;
    p.dtype = DType::kBFloat16;
    p.key = View{key.data(), 0, kHeads * kDim, kDim, 1};
    p.value = View{value.data(), 0, kHeads * kDim, kDim, 1};
    p.key_cache = MutableView{kc.data(), kBlockSize * kHeads * kDim, kHeads * kDim, kDim, 1};
    p.value_cache = MutableView{vc.data(), kBlockSize * kHeads * kDim, kHeads * kDim, kDim, 1};
    p.key_scale = MutableView{ks.data(), kBlockSize * kHeads, kHeads, 1, 0};
    p.value_scale = MutableView{vs.data(), kBlockSize * kHeads, kHeads, 1, 0};
    p.num_blocks = kBlocks;
    p.block_size = kBlockSize;
    p.slots = slots.data();
    kv_cache_write(p, ThreadExecutor(2));
    for (int64_t h = 0; h < kHeads; ++h) {
      float row[kDim];
      uint8_t want[kDim];
      for (int64_t e = 0; e < kDim; ++e) row[e] = bf16_bits_to_float(key[h * kDim + e]);
      EXPECT_EQ(ks[4 * kHeads + h], quantize_row(row, kDim, format, want));
      for (int64_t e = 0; e < kDim; ++e) EXPECT_EQ(kc[(4 * kHeads + h) * kDim + e], want[e]);
    }
    EXPECT_EQ(ks[0], -1.0f);  // slots nobody wrote keep their contents
    EXPECT_EQ(vc[0], 0xaa);
    p.key_scale.data = nullptr;
    EXPECT_THROW(kv_cache_write(p, SerialExecutor()), ArgumentError);
  }
}

}  // namespace
}  // namespace opmesh::core
