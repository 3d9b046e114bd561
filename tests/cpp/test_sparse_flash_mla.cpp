// sparse_flash_mla's forward and backward on every instruction set this CPU supports, against a
// double-precision evaluation of the formulas written here (one sequence, BSND; a window of
// ori_kv and the causal compressed entries of cmp_kv, one softmax with sinks), a planned forward
// with units split between workers, the same bits for any worker count, empty inputs with null
// pointers, and argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "attention/mla_plan.h"
#include "attention/sparse_flash_mla.h"
#include "errors.h"
#include "thread_executor.h"

namespace opmesh::core {
namespace {

// S = 19 queries over 19 original keys (window 5 to the left) and 19 / 4 = 4 compressed entries
// (residual 3); N1 = 6 over N2 = 2; D = 12.
constexpr int64_t S = 19, C = 4, RATIO = 4, RESIDUAL = 3, N1 = 6, N2 = 2, D = 12, WIN = 5;
constexpr int64_t G = N1 / N2;
constexpr float SCALE = 0.35f;

struct Data {
  std::vector<float> q, ori, cmp, dout, sinks;
  std::vector<int64_t> residual{RESIDUAL};
};

Data make_data() {
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0.0f, 1.0f);
  Data d;
  auto fill = [&](std::vector<float>& x, int64_t count) {
    x.resize(count);
    for (float& e : x) e = n(rng);
  };
  fill(d.q, S * N1 * D);
  fill(d.ori, S * N2 * D);
  fill(d.cmp, C * N2 * D);
  fill(d.dout, S * N1 * D);
  fill(d.sinks, N1);
  return d;
}

View view(const void* data, int64_t s, int64_t n) { return View{data, s * n * D, n * D, D, 1}; }

SparseFlashMlaParams make_params(const Data& d, std::vector<float>& out, std::vector<float>& lse) {
  SparseFlashMlaParams p;
  p.batch = 1;
  p.seq_q = S;
  p.heads_q = N1;
  p.heads_kv = N2;
  p.head_dim = D;
  p.ori.present = p.cmp.present = true;
  p.ori.seq = S;
  p.cmp.seq = C;
  p.ori.kv = view(d.ori.data(), S, N2);
  p.cmp.kv = view(d.cmp.data(), C, N2);
  p.ori.mask_mode = MaskMode::kWindow;
  p.ori.win_left = WIN;
  p.ori.win_right = 0;
  p.cmp.mask_mode = MaskMode::kCausal;
  p.cmp_ratio = RATIO;
  p.cmp_residuals = d.residual.data();
  p.scale = SCALE;
  p.q = view(d.q.data(), S, N1);
  p.sinks = d.sinks.data();
  out.assign(S * N1 * D, 0.0f);
  lse.assign(S * N1, 0.0f);
  p.out = MutableView{out.data(), S * N1 * D, N1 * D, D, 1};
  p.softmax_lse = lse.data();
  return p;
}

// Row i's keys: (tensor, position) pairs, ori's window then the compressed entries it passed.
std::vector<std::pair<const float*, int64_t>> keys_of(const Data& d, int64_t i) {
  std::vector<std::pair<const float*, int64_t>> out;
  for (int64_t j = std::max<int64_t>(0, i - WIN); j <= i; ++j) out.push_back({d.ori.data(), j});
  const int64_t position = i + C * RATIO + RESIDUAL - S;
  for (int64_t j = 0; j < C; ++j) {
    if ((j + 1) * RATIO <= position + 1) out.push_back({d.cmp.data(), j});
  }
  return out;
}

struct Reference {
  std::vector<double> out, lse, dq, dori, dcmp, dsinks;
};

Reference reference(const Data& d) {
  Reference r;
  r.out.assign(S * N1 * D, 0);
  r.lse.assign(S * N1, 0);
  r.dq.assign(S * N1 * D, 0);
  r.dori.assign(S * N2 * D, 0);
  r.dcmp.assign(C * N2 * D, 0);
  r.dsinks.assign(N1, 0);
  for (int64_t i = 0; i < S; ++i) {
    const auto keys = keys_of(d, i);
    for (int64_t h = 0; h < N1; ++h) {
      const int64_t g = h / G;
      const float* q = d.q.data() + (i * N1 + h) * D;
      const auto row = [&](const std::pair<const float*, int64_t>& k) {
        return k.first + (k.second * N2 + g) * D;
      };
      std::vector<double> s;
      for (const auto& k : keys) {
        double v = 0;
        for (int64_t e = 0; e < D; ++e) v += double(q[e]) * row(k)[e];
        s.push_back(SCALE * v);
      }
      double m = d.sinks[h];
      for (double v : s) m = std::max(m, v);
      double z = std::exp(double(d.sinks[h]) - m);
      for (double v : s) z += std::exp(v - m);
      const double lse = m + std::log(z);
      r.lse[(g * S + i) * G + h % G] = lse;  // [B, N2, S1, G]
      double* out = r.out.data() + (i * N1 + h) * D;
      for (size_t c = 0; c < keys.size(); ++c) {
        for (int64_t e = 0; e < D; ++e) out[e] += std::exp(s[c] - lse) * row(keys[c])[e];
      }
      const float* dout = d.dout.data() + (i * N1 + h) * D;
      double delta = 0;
      for (int64_t e = 0; e < D; ++e) delta += double(dout[e]) * out[e];
      r.dsinks[h] -= std::exp(double(d.sinks[h]) - lse) * delta;
      for (size_t c = 0; c < keys.size(); ++c) {
        const double p = std::exp(s[c] - lse);
        double dp = 0;
        for (int64_t e = 0; e < D; ++e) dp += double(dout[e]) * row(keys[c])[e];
        const double ds = SCALE * p * (dp - delta);
        double* dkv = (keys[c].first == d.ori.data() ? r.dori.data() : r.dcmp.data()) +
                      (keys[c].second * N2 + g) * D;
        for (int64_t e = 0; e < D; ++e) {
          r.dq[(i * N1 + h) * D + e] += ds * row(keys[c])[e];
          dkv[e] += ds * q[e] + p * dout[e];  // key part and value part
        }
      }
    }
  }
  return r;
}

void expect_near(const std::vector<float>& got, const std::vector<double>& want, double tol,
                 const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t e = 0; e < got.size(); ++e) {
    EXPECT_NEAR(got[e], want[e], tol * (1 + std::abs(want[e]))) << what << " " << e;
  }
}

struct Grads {
  std::vector<float> dq, dori, dcmp, dsinks;
};

Grads run_backward(const Data& d, const SparseFlashMlaParams& p, const std::vector<float>& out,
                   const std::vector<float>& lse, int workers, Isa isa) {
  Grads g{std::vector<float>(S * N1 * D), std::vector<float>(S * N2 * D),
          std::vector<float>(C * N2 * D), std::vector<float>(N1)};
  SparseFlashMlaGrads gr;
  gr.dout = view(d.dout.data(), S, N1);
  gr.out = view(out.data(), S, N1);
  gr.softmax_lse = lse.data();
  gr.dq = g.dq.data();
  gr.d_ori_kv = g.dori.data();
  gr.d_cmp_kv = g.dcmp.data();
  gr.dsinks = g.dsinks.data();
  sparse_flash_mla_backward(p, gr, ThreadExecutor(workers), isa);
  return g;
}

TEST(SparseFlashMlaCore, ForwardAndBackwardMatchTheFormulasOnEveryLevel) {
  const Data d = make_data();
  const Reference r = reference(d);
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(isa_name(isa));
    std::vector<float> out, lse;
    const SparseFlashMlaParams p = make_params(d, out, lse);
    sparse_flash_mla(p, ThreadExecutor(3), isa);
    expect_near(out, r.out, 2e-5, "out");
    expect_near(lse, r.lse, 2e-5, "lse");
    const Grads g = run_backward(d, p, out, lse, 3, isa);
    expect_near(g.dq, r.dq, 1e-4, "dq");
    expect_near(g.dori, r.dori, 1e-4, "d_ori_kv");
    expect_near(g.dcmp, r.dcmp, 1e-4, "d_cmp_kv");
    expect_near(g.dsinks, r.dsinks, 1e-4, "dsinks");
  }
}

TEST(SparseFlashMlaCore, PlannedForwardSplitsUnitsAndMatches) {
  const Data d = make_data();
  const Reference r = reference(d);
  std::vector<float> out, lse;
  const SparseFlashMlaParams p = make_params(d, out, lse);
  mla_plan::Config c = mla_plan::config_of(p, sparse_flash_mla_sequences(p));
  c.num_workers = 7;
  const mla_plan::Plan plan = mla_plan::make_plan(c, mla_plan::arrays_of(p));
  const int64_t cuts = std::count_if(plan.workers.begin(), plan.workers.end(),
                                     [](const mla_plan::Stretch& st) { return st.begin.key > 0; });
  EXPECT_GT(cuts, 0);
  std::vector<int32_t> words(mla_plan::size_words(7));
  mla_plan::write(plan, words.data());
  const mla_plan::Plan read = mla_plan::read(words.data(), static_cast<int64_t>(words.size()));
  mla_plan::verify(read, c, mla_plan::arrays_of(p), S);
  const sparse::TokenSchedule schedule =
      mla_plan::schedule(read, sparse_flash_mla_sequences(p).ori);
  EXPECT_FALSE(schedule.combines.empty());
  sparse_flash_mla(p, ThreadExecutor(2), detected_isa(), &schedule);
  expect_near(out, r.out, 2e-5, "planned out");
  expect_near(lse, r.lse, 2e-5, "planned lse");
}

TEST(SparseFlashMlaCore, SameBitsWhateverTheWorkerCount) {
  const Data d = make_data();
  std::vector<float> out1, lse1, out5, lse5;
  const SparseFlashMlaParams p1 = make_params(d, out1, lse1);
  const SparseFlashMlaParams p5 = make_params(d, out5, lse5);
  sparse_flash_mla(p1, ThreadExecutor(1), detected_isa());
  sparse_flash_mla(p5, ThreadExecutor(5), detected_isa());
  EXPECT_EQ(out1, out5);
  EXPECT_EQ(lse1, lse5);
  const Grads a = run_backward(d, p1, out1, lse1, 1, detected_isa());
  const Grads b = run_backward(d, p5, out5, lse5, 5, detected_isa());
  EXPECT_EQ(a.dq, b.dq);
  EXPECT_EQ(a.dori, b.dori);
  EXPECT_EQ(a.dcmp, b.dcmp);
  EXPECT_EQ(a.dsinks, b.dsinks);
}

TEST(SparseFlashMlaCore, EmptyBatchNeedsNoPointers) {
  SparseFlashMlaParams p;
  p.heads_q = 4;
  p.heads_kv = 1;
  p.head_dim = 8;
  p.ori.present = true;
  sparse_flash_mla(p, SerialExecutor(), detected_isa());
  p.batch = 2;
  p.seq_q = 0;
  p.ori.seq = 5;  // two sequences with keys and no queries
  sparse_flash_mla(p, SerialExecutor(), detected_isa());
}

TEST(SparseFlashMlaCore, BadArgumentsAreNamed) {
  const Data d = make_data();
  std::vector<float> out, lse;
  const auto expect_named = [&](const char* name, auto change) {
    SparseFlashMlaParams p = make_params(d, out, lse);
    change(p);
    try {
      sparse_flash_mla(p, SerialExecutor(), Isa::kScalar);
      ADD_FAILURE() << "no error for " << name;
    } catch (const ArgumentError& e) {
      EXPECT_EQ(std::string(e.what()).rfind(name, 0), 0u) << e.what();
    }
  };
  const std::vector<int64_t> big{RATIO};
  expect_named("cmp_residual_kv", [&](SparseFlashMlaParams& p) { p.cmp_residuals = big.data(); });
  expect_named("cmp_mask_mode",
               [](SparseFlashMlaParams& p) { p.cmp.mask_mode = MaskMode::kWindow; });
  expect_named("ori_win_left", [](SparseFlashMlaParams& p) { p.ori.win_left = -2; });
  expect_named("cmp_ratio", [](SparseFlashMlaParams& p) { p.cmp_ratio = 0; });
  expect_named("ori_kv", [](SparseFlashMlaParams& p) { p.ori.present = p.cmp.present = false; });
  expect_named("layout_kv", [](SparseFlashMlaParams& p) { p.layout_kv = Layout::kTND; });
  const std::vector<int64_t> used{S + 1};
  expect_named("seqused_ori_kv", [&](SparseFlashMlaParams& p) { p.ori.seqused = used.data(); });
}

}  // namespace
}  // namespace opmesh::core
