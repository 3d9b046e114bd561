// The core kernel on every instruction set this CPU supports, against a float64 reference
// written here from the formula (not from the kernel's tiling).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "aligned_buffer.h"
#include "errors.h"
#include "indexer/indexer.h"
#include "thread_executor.h"

namespace opmesh::core {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

uint16_t to_bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

struct Case {
  Layout layout;
  MaskMode mode;
  int64_t batch, s1, s2, n1, n2, d;
  std::vector<int64_t> qlens, klens;  // BSND: lengths (may be empty); TND: cumulative ends
  bool bf16;
};

struct Result {
  std::vector<float> max, sum;
};

// Inputs hold values exactly representable in bf16 so the float and bf16 runs see the same data.
struct Inputs {
  std::vector<float> q, k, w;
  std::vector<uint16_t> q16, k16;
};

Inputs make_inputs(const Case& c) {
  const int64_t tq = c.layout == Layout::kTND ? c.s1 : c.batch * c.s1;
  const int64_t tk = c.layout == Layout::kTND ? c.s2 : c.batch * c.s2;
  std::mt19937 rng(1234);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Inputs in;
  in.q.resize(tq * c.n1 * c.d);
  in.k.resize(tk * c.n2 * c.d);
  in.w.resize(tq * c.n1);
  for (auto* v : {&in.q, &in.k}) {
    for (float& x : *v) {
      const uint16_t b = to_bf16_bits(dist(rng));
      uint32_t u = static_cast<uint32_t>(b) << 16;
      std::memcpy(&x, &u, 4);
    }
  }
  for (float& x : in.w) x = dist(rng) * 0.1f;
  for (float x : in.q) in.q16.push_back(to_bf16_bits(x));
  for (float x : in.k) in.k16.push_back(to_bf16_bits(x));
  return in;
}

IndexerParams make_params(const Case& c, const Inputs& in, Result& out) {
  IndexerParams p;
  p.layout = c.layout;
  p.sparse_mode = c.mode;
  p.batch = c.batch;
  p.seq_q = c.s1;
  p.seq_k = c.s2;
  p.heads_q = c.n1;
  p.heads_k = c.n2;
  p.head_dim = c.d;
  p.qk_dtype = c.bf16 ? DType::kBFloat16 : DType::kFloat32;
  p.weights_dtype = DType::kFloat32;
  p.query.data = c.bf16 ? static_cast<const void*>(in.q16.data()) : in.q.data();
  p.key.data = c.bf16 ? static_cast<const void*>(in.k16.data()) : in.k.data();
  p.weights.data = in.w.data();
  const int64_t q_b = c.layout == Layout::kTND ? 0 : c.s1 * c.n1 * c.d;
  const int64_t k_b = c.layout == Layout::kTND ? 0 : c.s2 * c.n2 * c.d;
  const int64_t q_s[4] = {q_b, c.n1 * c.d, c.d, 1};
  const int64_t k_s[4] = {k_b, c.n2 * c.d, c.d, 1};
  p.query = View{p.query.data, q_s[0], q_s[1], q_s[2], q_s[3]};
  p.key = View{p.key.data, k_s[0], k_s[1], k_s[2], k_s[3]};
  p.weights.sb = c.layout == Layout::kTND ? 0 : c.s1 * c.n1;
  p.weights.ss = c.n1;
  p.weights.sn = 1;
  p.seq_q_lens = c.qlens.empty() ? nullptr : c.qlens.data();
  p.seq_k_lens = c.klens.empty() ? nullptr : c.klens.data();
  const int64_t rows = c.layout == Layout::kTND ? c.s1 : c.batch * c.s1;
  out.max.assign(rows * c.n2, 12345.0f);
  out.sum.assign(rows * c.n2, 12345.0f);
  p.softmax_max = out.max.data();
  p.softmax_sum = out.sum.data();
  return p;
}

// max_j I and sum_j exp(I - max) over visible keys, I from the formula in float64.
void reference(const Case& c, const Inputs& in, std::vector<double>& rmax,
               std::vector<double>& rsum) {
  const int64_t rows = c.layout == Layout::kTND ? c.s1 : c.batch * c.s1;
  rmax.assign(rows * c.n2, -kInf);
  rsum.assign(rows * c.n2, 0.0);
  const int64_t group = c.n1 / c.n2;
  for (int64_t b = 0; b < c.batch; ++b) {
    int64_t q0 = 0, k0 = 0, s1 = c.s1, s2 = c.s2;
    if (c.layout == Layout::kTND) {
      q0 = b ? c.qlens[b - 1] : 0;
      k0 = b ? c.klens[b - 1] : 0;
      s1 = c.qlens[b] - q0;
      s2 = c.klens[b] - k0;
    } else {
      q0 = b * c.s1;
      k0 = b * c.s2;
      if (!c.qlens.empty()) s1 = c.qlens[b];
      if (!c.klens.empty()) s2 = c.klens[b];
    }
    for (int64_t g = 0; g < c.n2; ++g) {
      for (int64_t i = 0; i < s1; ++i) {
        std::vector<double> scores;
        for (int64_t j = 0; j < s2; ++j) {
          if (c.mode == MaskMode::kCausal && j > i + s2 - s1) continue;
          double total = 0;
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            double dot = 0;
            for (int64_t d = 0; d < c.d; ++d) {
              dot += double(in.q[((q0 + i) * c.n1 + h) * c.d + d]) *
                     double(in.k[((k0 + j) * c.n2 + g) * c.d + d]);
            }
            total += double(in.w[(q0 + i) * c.n1 + h]) * std::max(dot, 0.0);
          }
          scores.push_back(total);
        }
        if (scores.empty()) continue;
        const double m = *std::max_element(scores.begin(), scores.end());
        double s = 0;
        for (double v : scores) s += std::exp(v - m);
        const int64_t out =
            c.layout == Layout::kTND ? g * c.s1 + q0 + i : (b * c.n2 + g) * c.s1 + i;
        rmax[out] = m;
        rsum[out] = s;
      }
    }
  }
}

// Worker counts 1 and 3 run the float32 set and the bf16-pair set respectively; more workers than
// query tiles make the planner split units along the keys and merge their partial statistics.
void check_case(const Case& c, std::vector<int> worker_counts = {1, 3}) {
  const Inputs in = make_inputs(c);
  std::vector<double> rmax, rsum;
  reference(c, in, rmax, rsum);
  for (Isa isa : supported_isas()) {
    // Both kernel sets bf16 inputs can take at avx512_bf16: float32 FMA (0) and bf16 pairs (1).
    for (int workers : worker_counts) {
      const int pairs = workers == 1 ? 0 : 1;
      Result out;
      IndexerParams p = make_params(c, in, out);
      p.bf16_pairs = pairs;
      const ThreadExecutor executor(workers);
      dense_lightning_indexer_softmax_lse(p, executor, isa);
      for (size_t r = 0; r < rmax.size(); ++r) {
        SCOPED_TRACE(::testing::Message() << isa_name(isa) << " workers " << workers << " pairs "
                                          << pairs << " row " << r);
        if (std::isinf(rmax[r])) {
          EXPECT_EQ(out.max[r], -std::numeric_limits<float>::infinity());
          EXPECT_EQ(out.sum[r], 0.0f);
          continue;
        }
        const double scale = 1.0 + std::abs(rmax[r]);
        EXPECT_NEAR(out.max[r], rmax[r], 2e-5 * scale);
        EXPECT_NEAR(out.sum[r], rsum[r], 2e-5 * scale * rsum[r]);
      }
    }
  }
}

TEST(IndexerCore, BsndCausalWithGroupsAndLengths) {
  check_case({Layout::kBSND, MaskMode::kCausal, 2, 37, 70, 6, 2, 17, {37, 11}, {70, 3}, false});
}

TEST(IndexerCore, BsndCausalMoreQueriesThanKeysBf16) {
  check_case({Layout::kBSND, MaskMode::kCausal, 1, 80, 9, 4, 1, 33, {}, {}, true});
}

TEST(IndexerCore, FewQueriesManyKeysSplitOverWorkers) {
  check_case({Layout::kBSND, MaskMode::kCausal, 2, 3, 1500, 4, 2, 40, {3, 1}, {1500, 700}, true},
             {1, 2, 5, 8});
  check_case({Layout::kBSND, MaskMode::kNone, 1, 1, 4000, 2, 1, 16, {}, {}, false}, {7});
}

TEST(IndexerCore, SameBitsWhateverTheWorkerCount) {
  const Case c{Layout::kBSND, MaskMode::kCausal, 1, 5, 5000, 4, 1, 24, {}, {}, false};
  const Inputs in = make_inputs(c);
  Result one;
  IndexerParams p = make_params(c, in, one);
  dense_lightning_indexer_softmax_lse(p, ThreadExecutor(1), detected_isa());
  for (int workers : {2, 3, 8}) {
    Result many;
    IndexerParams q = make_params(c, in, many);
    dense_lightning_indexer_softmax_lse(q, ThreadExecutor(workers), detected_isa());
    EXPECT_EQ(std::memcmp(one.max.data(), many.max.data(), one.max.size() * 4), 0) << workers;
    EXPECT_EQ(std::memcmp(one.sum.data(), many.sum.data(), one.sum.size() * 4), 0) << workers;
  }
}

TEST(IndexerCore, BsndNoMaskBf16OddDim) {
  check_case({Layout::kBSND, MaskMode::kNone, 2, 7, 130, 3, 3, 5, {}, {}, true});
}

TEST(IndexerCore, TndVarlenWithEmptySequence) {
  for (bool bf16 : {false, true}) {
    check_case({Layout::kTND,
                MaskMode::kCausal,
                4,
                60,
                100,
                8,
                2,
                16,
                {20, 20, 59, 60},
                {30, 30, 99, 100},
                bf16});
  }
}

TEST(IndexerCore, ValidationNamesTheArgument) {
  const Case c{Layout::kTND, MaskMode::kCausal, 2, 4, 4, 2, 1, 8, {2, 4}, {1, 4}, false};
  const Inputs in = make_inputs(c);
  Result out;
  IndexerParams p = make_params(c, in, out);
  const SerialExecutor ex;
  auto expect_arg = [&](const IndexerParams& bad, const std::string& arg) {
    try {
      dense_lightning_indexer_softmax_lse(bad, ex, Isa::kScalar);
      ADD_FAILURE() << "no error for " << arg;
    } catch (const ArgumentError& e) {
      EXPECT_EQ(e.argument(), arg) << e.what();
    }
  };
  const int64_t decreasing[] = {3, 2};
  const int64_t short_total[] = {1, 3};
  IndexerParams bad = p;
  bad.seq_q_lens = decreasing;
  expect_arg(bad, "actual_seq_qlen");
  bad = p;
  bad.seq_k_lens = short_total;
  expect_arg(bad, "actual_seq_klen");
  bad = p;
  bad.seq_q_lens = nullptr;
  expect_arg(bad, "actual_seq_qlen");
  bad = p;
  bad.heads_k = 3;
  expect_arg(bad, "key_index");
  bad = p;
  bad.sparse_mode = static_cast<MaskMode>(1);
  expect_arg(bad, "sparse_mode");
  bad = p;
  bad.weights_dtype = DType::kFloat16;
  expect_arg(bad, "weights");
  // The same head and head-dim limits as flash attention, checked before any scratch is sized.
  bad = p;
  bad.heads_q = int64_t{1} << 58;
  bad.heads_k = 1;
  expect_arg(bad, "query_index");
  bad = p;
  bad.head_dim = int64_t{1} << 40;
  expect_arg(bad, "query_index");
}

TEST(AlignedBuffer, SizeOverflowThrowsInsteadOfHoldingNull) {
  EXPECT_THROW(AlignedBuffer<float>(SIZE_MAX / 2), std::bad_alloc);
  EXPECT_THROW(AlignedBuffer<uint32_t>(SIZE_MAX - 3), std::bad_alloc);
  const AlignedBuffer<float> ok(17);
  EXPECT_NE(ok.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(ok.data()) % 64, 0u);
}

TEST(DType, Fp16ConversionIsExact) {
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const uint32_t e = (bits >> 10) & 0x1f, m = bits & 0x3ff;
    const double sign = (bits & 0x8000) ? -1.0 : 1.0;
    const float got = fp16_bits_to_float(static_cast<uint16_t>(bits));
    if (e == 0x1f) {
      EXPECT_TRUE(m ? std::isnan(got) : std::isinf(got)) << bits;
      continue;
    }
    const double want = e == 0 ? sign * std::ldexp(double(m), -24)
                               : sign * std::ldexp(1.0 + m / 1024.0, int(e) - 15);
    ASSERT_EQ(double(got), want) << bits;
  }
}

}  // namespace
}  // namespace opmesh::core
