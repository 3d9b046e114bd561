// The fused KL loss against a float64 evaluation written here from the formula (every score
// materialised, gradients by hand), on a TND batch with an empty sequence, rope, GQA on both
// attentions, a band, tiles cut at awkward sizes; the same bits for 1 and 3 workers; errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "dtype.h"
#include "errors.h"
#include "indexer/indexer.h"
#include "indexer/indexer_kl_loss.h"
#include "indexer/sparse_kl_loss.h"
#include "thread_executor.h"

namespace opmesh::core {
namespace {

constexpr int64_t kN1 = 4, kN2 = 2, kD = 6, kDr = 3, kN1i = 4, kN2i = 2, kDi = 5;

struct Problem {
  std::vector<int64_t> q_ends, k_ends;
  int64_t t1 = 0, t2 = 0;
  MaskMode mode = MaskMode::kCausal;
  int64_t pre = std::numeric_limits<int64_t>::max();
  std::vector<float> q, k, qr, kr, qi, ki, w, smax, ssum, imax, isum;
  float scale = 0.3f;
};

Problem make(unsigned seed) {
  Problem x;
  x.q_ends = {70, 70, 135};  // the middle sequence is empty
  x.k_ends = {80, 80, 200};
  x.t1 = x.q_ends.back();
  x.t2 = x.k_ends.back();
  x.pre = 45;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto fill = [&](std::vector<float>& a, int64_t n, float s) {
    a.resize(n);
    for (auto& e : a) e = s * nd(rng);
  };
  fill(x.q, x.t1 * kN1 * kD, 1.0f);
  fill(x.k, x.t2 * kN2 * kD, 1.0f);
  fill(x.qr, x.t1 * kN1 * kDr, 1.0f);
  fill(x.kr, x.t2 * kN2 * kDr, 1.0f);
  fill(x.qi, x.t1 * kN1i * kDi, 1.0f);
  fill(x.ki, x.t2 * kN2i * kDi, 1.0f);
  fill(x.w, x.t1 * kN1i, 0.3f);
  return x;
}

struct Seq {
  int64_t q0, ql, k0, kl;
};

std::vector<Seq> seqs(const Problem& x) {
  std::vector<Seq> out;
  for (size_t b = 0; b < x.q_ends.size(); ++b) {
    const int64_t q0 = b ? x.q_ends[b - 1] : 0, k0 = b ? x.k_ends[b - 1] : 0;
    out.push_back({q0, x.q_ends[b] - q0, k0, x.k_ends[b] - k0});
  }
  return out;
}

bool visible(const Problem& x, const Seq& s, int64_t i, int64_t j) {
  const int64_t d = i + s.kl - s.ql;
  return j <= d && j >= d - x.pre;
}

double main_logit(const Problem& x, int64_t t, int64_t h, int64_t j) {
  double acc = 0.0;
  const int64_t g = h / (kN1 / kN2);
  for (int64_t e = 0; e < kD; ++e)
    acc += double(x.q[(t * kN1 + h) * kD + e]) * x.k[(j * kN2 + g) * kD + e];
  for (int64_t e = 0; e < kDr; ++e) {
    acc += double(x.qr[(t * kN1 + h) * kDr + e]) * x.kr[(j * kN2 + g) * kDr + e];
  }
  return x.scale * acc;
}

double index_dot(const Problem& x, int64_t t, int64_t h, int64_t j) {
  const int64_t g = h / (kN1i / kN2i);
  double acc = 0.0;
  for (int64_t e = 0; e < kDi; ++e) {
    acc += double(x.qi[(t * kN1i + h) * kDi + e]) * x.ki[(j * kN2i + g) * kDi + e];
  }
  return acc;
}

// Exact statistics of both attentions (the operator's inputs), stored as float.
void statistics(Problem& x) {
  const int64_t group = kN1 / kN2;
  x.smax.assign(kN2 * x.t1 * group, -INFINITY);
  x.ssum.assign(kN2 * x.t1 * group, 0.0f);
  x.imax.assign(kN2i * x.t1, -INFINITY);
  x.isum.assign(kN2i * x.t1, 0.0f);
  for (const Seq& s : seqs(x)) {
    for (int64_t i = 0; i < s.ql; ++i) {
      const int64_t t = s.q0 + i;
      for (int64_t h = 0; h < kN1; ++h) {
        double m = -INFINITY, l = 0.0;
        for (int64_t j = 0; j < s.kl; ++j) {
          if (visible(x, s, i, j)) m = std::max(m, main_logit(x, t, h, s.k0 + j));
        }
        for (int64_t j = 0; j < s.kl; ++j) {
          if (visible(x, s, i, j)) l += std::exp(main_logit(x, t, h, s.k0 + j) - m);
        }
        const int64_t at = ((h / group) * x.t1 + t) * group + h % group;
        x.smax[at] = float(m);
        x.ssum[at] = float(l);
      }
    }
  }
}

struct Result {
  double loss = 0.0;
  std::vector<double> dqi, dki, dw;
};

// Whether token t's row for index key head g selects key j (sequence position): every key for
// the dense loss, sparse_indices' choice for the sparse one.
using Picked = std::function<bool(int64_t t, int64_t g, int64_t j)>;

// The loss and gradients from the formula, with the indexer's softmax computed exactly, over the
// visible keys each row picks.
Result reference(
    const Problem& x, const Picked& picked = [](int64_t, int64_t, int64_t) { return true; }) {
  const int64_t group = kN1 / kN2, igroup = kN1i / kN2i;
  Result r;
  r.dqi.assign(x.qi.size(), 0.0);
  r.dki.assign(x.ki.size(), 0.0);
  r.dw.assign(x.w.size(), 0.0);
  for (const Seq& s : seqs(x)) {
    for (int64_t i = 0; i < s.ql; ++i) {
      const int64_t t = s.q0 + i;
      for (int64_t g = 0; g < kN2i; ++g) {
        auto seen = [&](int64_t j) { return visible(x, s, i, j) && picked(t, g, j); };
        std::vector<double> p(s.kl, 0.0);
        double z = 0.0;
        for (int64_t j = 0; j < s.kl; ++j) {
          if (!seen(j)) continue;
          for (int64_t h = 0; h < kN1; ++h) {
            const int64_t at = ((h / group) * x.t1 + t) * group + h % group;
            p[j] += std::exp(main_logit(x, t, h, s.k0 + j) - x.smax[at]) / x.ssum[at];
          }
          z += p[j];
        }
        if (z <= 0.0) continue;
        std::vector<double> score(s.kl, -INFINITY);
        double m = -INFINITY;
        for (int64_t j = 0; j < s.kl; ++j) {
          if (!seen(j)) continue;
          double acc = 0.0;
          for (int64_t hl = 0; hl < igroup; ++hl) {
            const int64_t h = g * igroup + hl;
            acc += x.w[t * kN1i + h] * std::max(0.0, index_dot(x, t, h, s.k0 + j));
          }
          score[j] = acc;
          m = std::max(m, acc);
        }
        double l = 0.0;
        for (int64_t j = 0; j < s.kl; ++j) l += seen(j) ? std::exp(score[j] - m) : 0.0;
        for (int64_t j = 0; j < s.kl; ++j) {
          if (!seen(j)) continue;
          const double phat = p[j] / z;
          const double logq = score[j] - m - std::log(l);
          if (phat > 0.0) r.loss += phat * (std::log(phat) - logq);
          const double di = std::exp(logq) - phat;
          for (int64_t hl = 0; hl < igroup; ++hl) {
            const int64_t h = g * igroup + hl;
            const double dot = index_dot(x, t, h, s.k0 + j);
            r.dw[t * kN1i + h] += di * std::max(0.0, dot);
            if (dot <= 0.0) continue;
            const double c = di * x.w[t * kN1i + h];
            for (int64_t e = 0; e < kDi; ++e) {
              r.dqi[(t * kN1i + h) * kDi + e] += c * x.ki[((s.k0 + j) * kN2i + g) * kDi + e];
              r.dki[((s.k0 + j) * kN2i + g) * kDi + e] += c * x.qi[(t * kN1i + h) * kDi + e];
            }
          }
        }
      }
    }
  }
  return r;
}

struct Output {
  std::vector<float> dqi, dki, dw;
  float loss = 0.0f;
};

IndexerKlLossParams params(const Problem& x, Output& o) {
  IndexerKlLossParams p;
  p.layout = Layout::kTND;
  p.sparse_mode = x.mode;
  p.pre_tokens = x.pre;
  p.batch = static_cast<int64_t>(x.q_ends.size());
  p.seq_q = x.t1;
  p.seq_k = x.t2;
  p.heads_q = kN1;
  p.heads_k = kN2;
  p.head_dim = kD;
  p.rope_dim = kDr;
  p.index_heads_q = kN1i;
  p.index_heads_k = kN2i;
  p.index_dim = kDi;
  p.scale = x.scale;
  auto operand = [](const std::vector<float>& a, int64_t n, int64_t d) {
    KlOperand op;
    op.data = a.data();
    op.ss = n * d;
    op.sn = d;
    op.sd = 1;
    return op;
  };
  p.query = operand(x.q, kN1, kD);
  p.key = operand(x.k, kN2, kD);
  p.query_rope = operand(x.qr, kN1, kDr);
  p.key_rope = operand(x.kr, kN2, kDr);
  p.query_index = operand(x.qi, kN1i, kDi);
  p.key_index = operand(x.ki, kN2i, kDi);
  p.weights = operand(x.w, kN1i, 1);
  p.softmax_max = x.smax.data();
  p.softmax_sum = x.ssum.data();
  p.softmax_max_index = x.imax.data();
  p.softmax_sum_index = x.isum.data();
  p.seq_q_lens = x.q_ends.data();
  p.seq_k_lens = x.k_ends.data();
  o.dqi.assign(x.qi.size(), 0.0f);
  o.dki.assign(x.ki.size(), 0.0f);
  o.dw.assign(x.w.size(), 0.0f);
  auto grad = [&](std::vector<float>& a, int64_t n, int64_t d) {
    const KlOperand op = operand(a, n, d);  // the same strides
    KlGradient g;
    g.data = a.data();
    g.sb = op.sb;
    g.ss = op.ss;
    g.sn = op.sn;
    g.sd = op.sd;
    return g;
  };
  p.d_query_index = grad(o.dqi, kN1i, kDi);
  p.d_key_index = grad(o.dki, kN2i, kDi);
  p.d_weights = grad(o.dw, kN1i, 1);
  p.loss = &o.loss;
  return p;
}

// The indexer's statistics from the statistics operator (as a caller passes them).
void index_statistics(Problem& x) {
  IndexerParams p;
  p.layout = Layout::kTND;
  p.sparse_mode = x.mode;
  p.pre_tokens = x.pre;
  p.batch = static_cast<int64_t>(x.q_ends.size());
  p.seq_q = x.t1;
  p.seq_k = x.t2;
  p.heads_q = kN1i;
  p.heads_k = kN2i;
  p.head_dim = kDi;
  p.query = View{x.qi.data(), 0, kN1i * kDi, kDi, 1};
  p.key = View{x.ki.data(), 0, kN2i * kDi, kDi, 1};
  p.weights = View{x.w.data(), 0, kN1i, 1, 0};
  p.seq_q_lens = x.q_ends.data();
  p.seq_k_lens = x.k_ends.data();
  x.imax.assign(kN2i * x.t1, 0.0f);
  x.isum.assign(kN2i * x.t1, 0.0f);
  p.softmax_max = x.imax.data();
  p.softmax_sum = x.isum.data();
  dense_lightning_indexer_softmax_lse(p, SerialExecutor(), active_isa());
}

void expect_near_all(const std::vector<float>& got, const std::vector<double>& want,
                     const char* name) {
  double largest = 0.0;
  for (double v : want) largest = std::max(largest, std::abs(v));
  ASSERT_GT(largest, 0.0) << name;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 2e-5 * largest + 1e-6 * std::abs(want[i])) << name << " at " << i;
  }
}

TEST(IndexerKlLoss, MatchesTheFormulaOnEveryWorkerCount) {
  Problem x = make(3);
  statistics(x);
  index_statistics(x);
  const Result want = reference(x);
  Output serial;
  dense_lightning_indexer_grad_kl_loss(params(x, serial), SerialExecutor(), active_isa());
  EXPECT_NEAR(serial.loss, want.loss, 1e-5 + 2e-5 * std::abs(want.loss));
  expect_near_all(serial.dqi, want.dqi, "d_query_index");
  expect_near_all(serial.dki, want.dki, "d_key_index");
  expect_near_all(serial.dw, want.dw, "d_weights");
  Output threaded;
  dense_lightning_indexer_grad_kl_loss(params(x, threaded), ThreadExecutor(3), active_isa());
  EXPECT_EQ(serial.loss, threaded.loss);
  EXPECT_EQ(serial.dqi, threaded.dqi);
  EXPECT_EQ(serial.dki, threaded.dki);
  EXPECT_EQ(serial.dw, threaded.dw);
}

TEST(IndexerKlLoss, ErrorsNameTheArgument) {
  Problem x = make(4);
  statistics(x);
  index_statistics(x);
  auto message = [&](auto change) {
    Output o;
    IndexerKlLossParams p = params(x, o);
    change(p);
    try {
      dense_lightning_indexer_grad_kl_loss(p, SerialExecutor(), active_isa());
    } catch (const ArgumentError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  auto starts = [](const std::string& m, const char* name) { return m.rfind(name, 0) == 0; };
  EXPECT_TRUE(starts(message([](auto& p) { p.pre_tokens = -1; }), "pre_tokens"));
  EXPECT_TRUE(starts(message([](auto& p) { p.heads_k = 3; }), "key"));
  EXPECT_TRUE(starts(message([](auto& p) { p.key_rope.data = nullptr; }), "key_rope"));
  EXPECT_TRUE(starts(message([](auto& p) { p.softmax_sum = nullptr; }), "softmax_sum"));
  EXPECT_TRUE(starts(message([](auto& p) { p.index_heads_k = 3; }), "key_index"));
  EXPECT_TRUE(starts(message([](auto& p) { p.scale = NAN; }), "scale_value"));
  EXPECT_TRUE(starts(message([](auto& p) { p.loss = nullptr; }), "loss"));
}

// sparse_indices [T1, heads, K] for the TND problem: per row, `choose(t, n, j)` decides whether
// key j (sequence position) is listed; listed keys in descending order (an order the operator
// must not depend on), -1 padding mixed in at the front and the back.
struct Indices {
  std::vector<int32_t> data;
  int64_t heads = 1, count = 0;
};

Indices make_indices(const Problem& x, int64_t heads,
                     const std::function<bool(int64_t, int64_t, int64_t)>& choose) {
  Indices ix;
  ix.heads = heads;
  int64_t longest = 0;
  for (const Seq& s : seqs(x)) longest = std::max(longest, s.kl);
  ix.count = longest + 3;
  ix.data.assign(x.t1 * heads * ix.count, -1);
  for (const Seq& s : seqs(x)) {
    for (int64_t i = 0; i < s.ql; ++i) {
      for (int64_t n = 0; n < heads; ++n) {
        int32_t* row = ix.data.data() + ((s.q0 + i) * heads + n) * ix.count;
        int64_t e = 1;  // entry 0 stays -1
        for (int64_t j = s.kl - 1; j >= 0; --j) {
          if (choose(s.q0 + i, n, j)) row[e++] = static_cast<int32_t>(j);
        }
      }
    }
  }
  return ix;
}

SparseKlLossParams sparse_params(const Problem& x, Output& o, const Indices& ix) {
  SparseKlLossParams p;
  p.dense = params(x, o);
  p.dense.softmax_max_index = nullptr;  // not read
  p.dense.softmax_sum_index = nullptr;
  p.indices = View{ix.data.data(), 0, ix.heads * ix.count, ix.count, 1};
  p.index_heads = ix.heads;
  p.sparse_count = ix.count;
  return p;
}

void expect_same(const Output& a, const Output& b) {
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.dqi, b.dqi);
  EXPECT_EQ(a.dki, b.dki);
  EXPECT_EQ(a.dw, b.dw);
}

TEST(SparseKlLoss, EveryKeySelectedIsTheDenseLoss) {
  Problem x = make(5);
  statistics(x);
  const Result want = reference(x);
  const Indices all = make_indices(x, 1, [](int64_t, int64_t, int64_t) { return true; });
  Output serial;
  sparse_lightning_indexer_grad_kl_loss(sparse_params(x, serial, all), SerialExecutor(),
                                        active_isa());
  EXPECT_NEAR(serial.loss, want.loss, 1e-5 + 2e-5 * std::abs(want.loss));
  expect_near_all(serial.dqi, want.dqi, "d_query_index");
  expect_near_all(serial.dki, want.dki, "d_key_index");
  expect_near_all(serial.dw, want.dw, "d_weights");
}

TEST(SparseKlLoss, MatchesTheFormulaOnSubsetsOnEveryWorkerCount) {
  Problem x = make(6);
  statistics(x);  // the dense statistics: the target is renormalised on the selected keys
  // Per index key head a different pseudo-random half of the keys (some rows pick none of the
  // visible ones), then one selection shared by both heads.
  auto choose = [](int64_t t, int64_t n, int64_t j) { return (t * 7 + j * 13 + n * 5) % 11 < 5; };
  for (int64_t heads : {kN2i, int64_t{1}}) {
    const Indices ix = make_indices(x, heads, choose);
    const Result want = reference(
        x, [&](int64_t t, int64_t g, int64_t j) { return choose(t, heads == 1 ? 0 : g, j); });
    for (Isa isa : supported_isas()) {
      SCOPED_TRACE(isa_name(isa));
      Output o;
      sparse_lightning_indexer_grad_kl_loss(sparse_params(x, o, ix), SerialExecutor(), isa);
      EXPECT_NEAR(o.loss, want.loss, 1e-5 + 2e-5 * std::abs(want.loss)) << heads;
      expect_near_all(o.dqi, want.dqi, "d_query_index");
      expect_near_all(o.dki, want.dki, "d_key_index");
      expect_near_all(o.dw, want.dw, "d_weights");
    }
    Output serial;
    sparse_lightning_indexer_grad_kl_loss(sparse_params(x, serial, ix), SerialExecutor(),
                                          active_isa());
    for (int workers : {2, 3, 5}) {
      Output threaded;
      sparse_lightning_indexer_grad_kl_loss(sparse_params(x, threaded, ix), ThreadExecutor(workers),
                                            active_isa());
      expect_same(serial, threaded);
    }
  }
}

// The second pass takes the index scores' signs kept by the first, or recomputes them when they
// do not fit the budget: the same bits either way, on every kernel set and selection, with
// float32 index inputs and with bf16 ones (the pair sets' coefficient rows built from the signs),
// and with bf16 weights (there the signs select the weights themselves).
TEST(SparseKlLoss, KeptAndRecomputedSignsGiveTheSameBits) {
  Problem x = make(7);
  statistics(x);
  auto choose = [](int64_t t, int64_t n, int64_t j) { return (t * 5 + j * 3 + n) % 7 < 4; };
  auto bf16 = [](const std::vector<float>& a) {
    std::vector<uint16_t> out(a.size());
    for (size_t e = 0; e < a.size(); ++e) out[e] = float_to_bf16_bits(a[e]);
    return out;
  };
  const std::vector<uint16_t> qi16 = bf16(x.qi), ki16 = bf16(x.ki), w16 = bf16(x.w);
  for (int64_t heads : {kN2i, int64_t{1}}) {
    const Indices ix = make_indices(x, heads, choose);
    for (Isa isa : supported_isas()) {
      for (const int half : {0, 1, 2}) {
        SCOPED_TRACE(std::string(isa_name(isa)) + " bf16 operands " + std::to_string(half));
        Output kept, recomputed;
        auto run = [&](Output& o, int64_t budget) {
          SparseKlLossParams p = sparse_params(x, o, ix);
          if (half) {
            p.dense.query_index.data = qi16.data();
            p.dense.query_index.dtype = DType::kBFloat16;
            p.dense.key_index.data = ki16.data();
            p.dense.key_index.dtype = DType::kBFloat16;
          }
          if (half == 2) {
            p.dense.weights.data = w16.data();
            p.dense.weights.dtype = DType::kBFloat16;
          }
          p.sign_budget_bytes = budget;
          sparse_lightning_indexer_grad_kl_loss(p, ThreadExecutor(3), isa);
        };
        run(kept, int64_t{1} << 30);
        run(recomputed, 0);
        expect_same(kept, recomputed);
        EXPECT_TRUE(
            std::any_of(kept.dki.begin(), kept.dki.end(), [](float v) { return v != 0.0f; }));
      }
    }
  }
}

TEST(SparseKlLoss, ErrorsNameTheArgument) {
  Problem x = make(7);
  statistics(x);
  Indices ix = make_indices(x, 1, [](int64_t t, int64_t, int64_t j) { return (t + j) % 3 == 0; });
  auto message = [&](auto change) {
    Output o;
    Indices copy = ix;
    SparseKlLossParams p = sparse_params(x, o, copy);
    change(p, copy);
    try {
      sparse_lightning_indexer_grad_kl_loss(p, SerialExecutor(), active_isa());
    } catch (const ArgumentError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  auto starts = [](const std::string& m, const char* name) { return m.rfind(name, 0) == 0; };
  EXPECT_EQ(message([](auto&, auto&) {}), "no error");
  EXPECT_TRUE(starts(message([](auto& p, auto&) { p.dense.heads_k = 3; }), "key"));
  EXPECT_TRUE(
      starts(message([](auto& p, auto&) { p.dense.softmax_max = nullptr; }), "softmax_max"));
  EXPECT_TRUE(starts(message([](auto& p, auto&) { p.index_heads = 3; }), "sparse_indices"));
  EXPECT_TRUE(starts(message([](auto& p, auto&) { p.sparse_count = -1; }), "sparse_indices"));
  // An entry past its sequence's keys, below -1, and a repeated key.
  const int64_t k = ix.count;
  EXPECT_TRUE(starts(message([&](auto&, auto& c) { c.data[5 * k + 2] = 80; }), "sparse_indices"));
  EXPECT_TRUE(starts(message([&](auto&, auto& c) { c.data[5 * k + 2] = -2; }), "sparse_indices"));
  const std::string twice = message([&](auto&, auto& c) {
    c.data[5 * k + 1] = 4;
    c.data[5 * k + 2] = 4;
  });
  EXPECT_TRUE(starts(twice, "sparse_indices")) << twice;
  EXPECT_NE(twice.find("twice"), std::string::npos) << twice;
}

// A NaN or an infinity in any row the call reads makes the loss and every gradient row NaN, on
// both losses; a statistic's max of -inf is a head without target mass, not a non-finite input.
TEST(KlLosses, ANonFiniteValueReadMakesEveryResultNaN) {
  Problem clean = make(8);
  statistics(clean);
  index_statistics(clean);
  const Indices all = make_indices(clean, 1, [](int64_t, int64_t, int64_t) { return true; });
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  using Field = std::vector<float> Problem::*;
  const std::pair<Field, float> changes[] = {
      {&Problem::q, nan},    {&Problem::k, inf},     {&Problem::qr, -inf}, {&Problem::kr, nan},
      {&Problem::qi, inf},   {&Problem::ki, nan},    {&Problem::w, -inf},  {&Problem::smax, nan},
      {&Problem::smax, inf}, {&Problem::ssum, -inf}, {&Problem::ssum, nan}};
  auto all_nan = [](const std::vector<float>& v) {
    return std::all_of(v.begin(), v.end(), [](float e) { return std::isnan(e); });
  };
  for (const auto& [field, value] : changes) {
    Problem x = clean;
    (x.*field)[(x.*field).size() / 2 + 1] = value;  // a row of the last sequence
    Output dense, sparse;
    dense_lightning_indexer_grad_kl_loss(params(x, dense), ThreadExecutor(2), active_isa());
    sparse_lightning_indexer_grad_kl_loss(sparse_params(x, sparse, all), ThreadExecutor(2),
                                          active_isa());
    for (const Output* o : {&dense, &sparse}) {
      EXPECT_TRUE(std::isnan(o->loss));
      EXPECT_TRUE(all_nan(o->dqi) && all_nan(o->dki) && all_nan(o->dw));
    }
  }
  // A head whose max is -inf (or whose sum is 0) has no target mass: finite results.
  for (const bool max : {true, false}) {
    Problem x = clean;
    (max ? x.smax : x.ssum)[x.smax.size() / 2 + 1] = max ? -inf : 0.0f;
    Output dense, sparse;
    dense_lightning_indexer_grad_kl_loss(params(x, dense), SerialExecutor(), active_isa());
    sparse_lightning_indexer_grad_kl_loss(sparse_params(x, sparse, all), SerialExecutor(),
                                          active_isa());
    for (const Output* o : {&dense, &sparse}) {
      EXPECT_TRUE(std::isfinite(o->loss));
      for (const auto* v : {&o->dqi, &o->dki, &o->dw}) {
        EXPECT_TRUE(std::all_of(v->begin(), v->end(), [](float e) { return std::isfinite(e); }));
      }
    }
  }
}

TEST(IndexerKlLoss, BandMasksMapToTheVocabulary) {
  const int64_t inf = std::numeric_limits<int64_t>::max();
  const Mask none = indexer_mask(MaskMode::kNone, inf, inf);
  EXPECT_EQ(none.mode, MaskMode::kNone);
  const Mask causal = indexer_mask(MaskMode::kCausal, inf, 5);
  EXPECT_EQ(causal.mode, MaskMode::kCausal);
  const Mask band = indexer_mask(MaskMode::kCausal, 7, inf);
  EXPECT_EQ(band.mode, MaskMode::kWindow);
  EXPECT_EQ(band.left, 7);
  EXPECT_EQ(band.right, 0);
  const Mask both = indexer_mask(MaskMode::kNone, inf, 3);
  EXPECT_EQ(both.mode, MaskMode::kWindow);
  EXPECT_EQ(both.left, -1);
  EXPECT_EQ(both.right, 3);
  EXPECT_THROW(indexer_mask(MaskMode::kWindow, inf, inf), ArgumentError);
}

}  // namespace
}  // namespace opmesh::core
