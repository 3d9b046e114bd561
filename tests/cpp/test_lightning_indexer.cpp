// lightning_indexer's top-k on every instruction set this CPU supports, against a float64
// reference written here from the formula. Inputs are small integers (weights halves), so every
// score is exact in float32 and bf16 products: the selection, its order and its ties must match
// the reference exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "errors.h"
#include "indexer/lightning_indexer.h"
#include "thread_executor.h"

namespace opmesh::core {
namespace {

constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max();

uint16_t bf16_of_exact(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>(u >> 16);  // exact: the values have at most 8 significant bits
}

struct Case {
  Layout lq = Layout::kBSND;
  Layout lk = Layout::kBSND;
  MaskMode mode = MaskMode::kCausal;
  int64_t batch = 1, s1 = 1, s2 = 1, n1 = 1, n2 = 1, d = 1, k = 1;
  std::vector<int64_t> qlens, klens;  // as the params take them
  int64_t pre = kUnbounded, next = kUnbounded;
  int64_t block_size = 0;  // paged keys when > 0
};

struct Seq {
  int64_t q0, qlen, k0, klen;  // k0: row of the logical key tensor [tokens][N2][D]
};

Seq seq_of(const Case& c, int64_t b) {
  Seq s{};
  if (c.lq == Layout::kTND) {
    s.q0 = b ? c.qlens[b - 1] : 0;
    s.qlen = c.qlens[b] - s.q0;
  } else {
    s.q0 = b * c.s1;
    s.qlen = c.qlens.empty() ? c.s1 : c.qlens[b];
  }
  if (c.lk == Layout::kTND) {
    s.k0 = b ? c.klens[b - 1] : 0;
    s.klen = c.klens[b] - s.k0;
  } else {
    s.k0 = b * c.s2;
    s.klen = c.klens.empty() ? c.s2 : c.klens[b];
  }
  return s;
}

struct Inputs {
  std::vector<float> q, k, w, cache;  // k: logical keys; cache: paged copy
  std::vector<uint16_t> q16, k16, cache16;
  std::vector<int64_t> table;
  int64_t max_blocks = 0, blocks = 0;
};

Inputs make_inputs(const Case& c) {
  const int64_t tq = c.lq == Layout::kTND ? c.s1 : c.batch * c.s1;
  const int64_t tk = c.lk == Layout::kTND ? c.s2 : c.batch * c.s2;
  std::mt19937 rng(77);
  std::uniform_int_distribution<int> small(-2, 2);
  Inputs in;
  in.q.resize(tq * c.n1 * c.d);
  in.k.resize(tk * c.n2 * c.d);
  in.w.resize(tq * c.n1);
  for (float& x : in.q) x = static_cast<float>(small(rng));
  for (float& x : in.k) x = static_cast<float>(small(rng));
  for (float& x : in.w) x = 0.5f * static_cast<float>(small(rng)) + (small(rng) > 0 ? 1.0f : 0.0f);
  if (c.block_size > 0) {
    in.max_blocks = (c.s2 + c.block_size - 1) / c.block_size + 1;
    in.blocks = c.batch * in.max_blocks + 3;
    std::vector<int64_t> order(in.blocks);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    in.table.assign(order.begin(), order.begin() + c.batch * in.max_blocks);
    const int64_t row = c.n2 * c.d;
    in.cache.assign(in.blocks * c.block_size * row, 1000.0f);  // garbage where no key lives
    for (int64_t b = 0; b < c.batch; ++b) {
      for (int64_t j = 0; j < c.s2; ++j) {
        const int64_t block = in.table[b * in.max_blocks + j / c.block_size];
        std::copy_n(in.k.begin() + (b * c.s2 + j) * row, row,
                    in.cache.begin() + (block * c.block_size + j % c.block_size) * row);
      }
    }
  }
  for (float x : in.q) in.q16.push_back(bf16_of_exact(x));
  for (float x : in.k) in.k16.push_back(bf16_of_exact(x));
  for (float x : in.cache) in.cache16.push_back(bf16_of_exact(x));
  return in;
}

struct Output {
  std::vector<int32_t> indices;
  std::vector<float> values;
};

LightningIndexerParams make_params(const Case& c, const Inputs& in, bool bf16, Output& out) {
  LightningIndexerParams p;
  p.layout_query = c.lq;
  p.layout_key = c.block_size > 0 ? Layout::kPagedBBND : c.lk;
  p.sparse_mode = c.mode;
  p.pre_tokens = c.pre;
  p.next_tokens = c.next;
  p.batch = c.batch;
  p.seq_q = c.s1;
  p.seq_k = c.s2;
  p.heads_q = c.n1;
  p.heads_k = c.n2;
  p.head_dim = c.d;
  p.sparse_count = c.k;
  p.qk_dtype = bf16 ? DType::kBFloat16 : DType::kFloat32;
  p.weights_dtype = DType::kFloat32;
  const bool paged = c.block_size > 0;
  p.query.data = bf16 ? static_cast<const void*>(in.q16.data()) : in.q.data();
  p.key.data = paged ? (bf16 ? static_cast<const void*>(in.cache16.data()) : in.cache.data())
                     : (bf16 ? static_cast<const void*>(in.k16.data()) : in.k.data());
  p.weights.data = in.w.data();
  const bool tnd = c.lq == Layout::kTND;
  const int64_t qs[4] = {c.s1 * c.n1 * c.d, c.n1 * c.d, c.d, 1};
  const int64_t ks[4] = {(paged ? c.block_size : c.s2) * c.n2 * c.d, c.n2 * c.d, c.d, 1};
  const int64_t ws[3] = {c.s1 * c.n1, c.n1, 1};
  p.query = View{p.query.data, qs[0], qs[1], qs[2], qs[3]};
  p.key = View{p.key.data, ks[0], ks[1], ks[2], ks[3]};
  p.weights = View{p.weights.data, ws[0], ws[1], ws[2], 0};
  if (tnd) p.query.sb = p.weights.sb = 0;
  p.seq_q_lens = c.qlens.empty() ? nullptr : c.qlens.data();
  p.seq_k_lens = c.klens.empty() ? nullptr : c.klens.data();
  if (paged) {
    p.block_table = in.table.data();
    p.max_blocks = in.max_blocks;
    p.block_size = c.block_size;
    p.block_count = in.blocks;
  }
  const int64_t rows = tnd ? c.s1 : c.batch * c.s1;
  out.indices.assign(rows * c.n2 * c.k, 12345);
  out.values.assign(rows * c.n2 * c.k, 12345.0f);
  p.indices = out.indices.data();
  p.values = out.values.data();
  return p;
}

bool visible(const Case& c, const Seq& s, int64_t i, int64_t j) {
  const int64_t diag = i + s.klen - s.qlen;
  if (c.mode == MaskMode::kCausal && j > diag) return false;
  if (c.pre != kUnbounded && j < diag - c.pre) return false;
  if (c.mode == MaskMode::kNone && c.next != kUnbounded && j > diag + c.next) return false;
  return true;
}

// The reference output: for each row, keys by descending float64 score then ascending position.
Output reference(const Case& c, const Inputs& in) {
  const int64_t rows = c.lq == Layout::kTND ? c.s1 : c.batch * c.s1;
  Output out;
  out.indices.assign(rows * c.n2 * c.k, -1);
  out.values.assign(rows * c.n2 * c.k, -std::numeric_limits<float>::infinity());
  const int64_t group = c.n1 / c.n2;
  for (int64_t b = 0; b < c.batch; ++b) {
    const Seq s = seq_of(c, b);
    for (int64_t i = 0; i < s.qlen; ++i) {
      for (int64_t g = 0; g < c.n2; ++g) {
        std::vector<std::pair<double, int64_t>> scored;
        for (int64_t j = 0; j < s.klen; ++j) {
          if (!visible(c, s, i, j)) continue;
          double total = 0;
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            double dot = 0;
            for (int64_t e = 0; e < c.d; ++e) {
              dot += double(in.q[((s.q0 + i) * c.n1 + h) * c.d + e]) *
                     double(in.k[((s.k0 + j) * c.n2 + g) * c.d + e]);
            }
            total += double(in.w[(s.q0 + i) * c.n1 + h]) * std::max(dot, 0.0);
          }
          scored.emplace_back(total, j);
        }
        std::sort(scored.begin(), scored.end(), [](const auto& x, const auto& y) {
          return x.first != y.first ? x.first > y.first : x.second < y.second;
        });
        const int64_t row = (s.q0 + i) * c.n2 + g;
        for (int64_t r = 0; r < std::min<int64_t>(c.k, scored.size()); ++r) {
          out.indices[row * c.k + r] = static_cast<int32_t>(scored[r].second);
          out.values[row * c.k + r] = static_cast<float>(scored[r].first);
        }
      }
    }
  }
  return out;
}

void check_case(const Case& c, std::vector<int> worker_counts = {1, 3}) {
  const Inputs in = make_inputs(c);
  const Output want = reference(c, in);
  for (Isa isa : supported_isas()) {
    for (bool bf16 : {false, true}) {
      for (int workers : worker_counts) {
        Output got;
        LightningIndexerParams p = make_params(c, in, bf16, got);
        p.bf16_pairs = workers == 1 ? 0 : 1;
        lightning_indexer(p, ThreadExecutor(workers), isa);
        SCOPED_TRACE(::testing::Message()
                     << isa_name(isa) << " bf16 " << bf16 << " workers " << workers);
        EXPECT_EQ(got.indices, want.indices);
        EXPECT_EQ(got.values, want.values);
      }
    }
  }
}

TEST(LightningIndexerCore, BsndCausalGroupsLengthsAndShortRows) {
  Case c;
  c.batch = 2, c.s1 = 37, c.s2 = 70, c.n1 = 6, c.n2 = 2, c.d = 17, c.k = 9;
  c.qlens = {37, 11};
  c.klens = {70, 3};
  check_case(c);
}

TEST(LightningIndexerCore, KLargerThanEveryRowAndNoMask) {
  Case c;
  c.mode = MaskMode::kNone;
  c.batch = 2, c.s1 = 5, c.s2 = 130, c.n1 = 3, c.n2 = 3, c.d = 5, c.k = 200;
  check_case(c);
}

TEST(LightningIndexerCore, TndVarlenWithEmptySequenceAndBand) {
  Case c;
  c.lq = c.lk = Layout::kTND;
  c.batch = 4, c.s1 = 60, c.s2 = 100, c.n1 = 8, c.n2 = 2, c.d = 16, c.k = 16;
  c.qlens = {20, 20, 59, 60};
  c.klens = {30, 30, 99, 100};
  check_case(c);
  c.pre = 7;
  check_case(c);
  c.mode = MaskMode::kNone;
  c.next = 3;
  check_case(c);
}

TEST(LightningIndexerCore, PagedKeysUnderBsndAndTndQueries) {
  Case c;
  c.lk = Layout::kPagedBBND;
  c.batch = 3, c.s1 = 4, c.s2 = 150, c.n1 = 4, c.n2 = 1, c.d = 8, c.k = 32, c.block_size = 16;
  c.klens = {150, 1, 77};
  check_case(c);
  Case t = c;
  t.lq = Layout::kTND;
  t.s1 = 7;
  t.qlens = {1, 1, 7};
  t.block_size = 5;
  check_case(t);
}

TEST(LightningIndexerCore, DecodeSplitsKeysOverWorkersWithTheSameResult) {
  Case c;
  c.batch = 1, c.s1 = 1, c.s2 = 5000, c.n1 = 4, c.n2 = 1, c.d = 24, c.k = 100;
  check_case(c, {1, 2, 5, 8});
  c.k = 1;
  check_case(c, {3});
}

TEST(LightningIndexerCore, NaNRanksFirstAndNegativeZeroEqualsZero) {
  Case c;
  c.mode = MaskMode::kNone;
  c.s1 = 1, c.s2 = 4, c.n1 = 1, c.n2 = 1, c.d = 1, c.k = 4;
  Inputs in = make_inputs(c);
  in.q = {1.0f};
  in.w = {-1.0f};
  in.k = {0.0f, 3.0f, std::numeric_limits<float>::quiet_NaN(), 0.0f};  // scores -0, -3, NaN, -0
  Output got;
  LightningIndexerParams p = make_params(c, in, false, got);
  lightning_indexer(p, ThreadExecutor(1), Isa::kScalar);
  EXPECT_EQ(got.indices, (std::vector<int32_t>{2, 0, 3, 1}));
  EXPECT_TRUE(std::isnan(got.values[0]));
  EXPECT_EQ(got.values[1], 0.0f);
  EXPECT_EQ(got.values[3], -3.0f);
}

TEST(LightningIndexerCore, ValidationNamesTheArgument) {
  Case c;
  c.lk = Layout::kPagedBBND;
  c.batch = 2, c.s1 = 2, c.s2 = 20, c.n1 = 2, c.n2 = 1, c.d = 4, c.k = 4, c.block_size = 8;
  c.klens = {20, 5};
  const Inputs in = make_inputs(c);
  auto expect_argument = [&](const char* name, auto&& edit) {
    Output out;
    Inputs copy = in;
    LightningIndexerParams p = make_params(c, copy, false, out);
    edit(p, copy);
    try {
      lightning_indexer(p, SerialExecutor(), Isa::kScalar);
      ADD_FAILURE() << "no error for " << name;
    } catch (const ArgumentError& e) {
      EXPECT_EQ(std::string(e.what()).rfind(name, 0), 0u) << e.what();
    }
  };
  expect_argument("sparse_count", [](auto& p, auto&) { p.sparse_count = 0; });
  expect_argument("sparse_count", [](auto& p, auto&) { p.sparse_count = kMaxSparseCount + 1; });
  expect_argument("block_table", [](auto& p, auto& in) { in.table[1] = in.blocks; });
  expect_argument("block_table", [](auto& p, auto&) { p.max_blocks = 2; });
  expect_argument("actual_seq_lengths_key", [](auto& p, auto&) { p.seq_k_lens = nullptr; });
  expect_argument("layout_key", [](auto& p, auto&) { p.layout_key = Layout::kTND; });
  expect_argument("key", [](auto& p, auto&) { p.heads_k = 3; });
  expect_argument("pre_tokens", [](auto& p, auto&) { p.pre_tokens = -1; });
}

}  // namespace
}  // namespace opmesh::core
