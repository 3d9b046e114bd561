// sparse_flash_attention's forward and backward on every instruction set this CPU supports,
// against a double-precision evaluation of the formulas written here (BSND, GQA, rope, sinks,
// sparse blocks, -1 entries), the same bits for any worker count, and index validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "attention/sparse_attention.h"
#include "errors.h"
#include "thread_executor.h"

namespace opmesh::core {
namespace {

// B = 1, S1 = S2 = S, causal; N1 = 4 over N2 = 2; D = 8, Dr = 4, Dv = 6; blocks of 2 keys. S is
// more than one span of the backward's query tokens (1024).
constexpr int64_t S = 1100, N1 = 4, N2 = 2, D = 8, DR = 4, DV = 6, K = 5, BS = 2;
constexpr int64_t G = N1 / N2;

struct Data {
  std::vector<float> q, k, v, qr, kr, dout, sinks;
  std::vector<int32_t> idx;  // [S][N2][K]
};

Data make_data() {
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 1.0f);
  Data d;
  auto fill = [&](std::vector<float>& x, int64_t count) {
    x.resize(count);
    for (float& e : x) e = n(rng);
  };
  fill(d.q, S * N1 * D);
  fill(d.k, S * N2 * D);
  fill(d.v, S * N2 * DV);
  fill(d.qr, S * N1 * DR);
  fill(d.kr, S * N2 * DR);
  fill(d.dout, S * N1 * DV);
  fill(d.sinks, N1);
  d.idx.assign(S * N2 * K, -1);
  const int64_t blocks = (S + BS - 1) / BS;
  for (int64_t r = 0; r < S * N2; ++r) {
    std::vector<int32_t> order(blocks);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t e = 0; e < K - 1; ++e) d.idx[r * K + e] = order[e];  // the last stays -1
  }
  return d;
}

SparseAttentionParams make_params(const Data& d, std::vector<float>& out, std::vector<float>& m,
                                  std::vector<float>& l) {
  SparseAttentionParams p;
  p.batch = 1;
  p.seq_q = p.seq_k = S;
  p.heads_q = N1;
  p.heads_k = N2;
  p.head_dim = D;
  p.rope_dim = DR;
  p.value_dim = DV;
  p.index_heads = N2;
  p.sparse_count = K;
  p.sparse_block_size = BS;
  p.scale = 0.4f;
  // A contiguous [B, S, n, dim] tensor's view.
  auto view = [](const void* data, int64_t n, int64_t dim) {
    return View{data, S * n * dim, n * dim, dim, 1};
  };
  p.query = view(d.q.data(), N1, D);
  p.key = view(d.k.data(), N2, D);
  p.value = view(d.v.data(), N2, DV);
  p.query_rope = view(d.qr.data(), N1, DR);
  p.key_rope = view(d.kr.data(), N2, DR);
  p.indices = view(d.idx.data(), N2, K);
  p.sinks = d.sinks.data();
  out.assign(S * N1 * DV, 0.0f);
  m.assign(S * N1, 0.0f);
  l.assign(S * N1, 0.0f);
  p.out = MutableView{out.data(), S * N1 * DV, N1 * DV, DV, 1};
  p.softmax_max = m.data();
  p.softmax_sum = l.data();
  return p;
}

// The keys row (i, g) selects, and P (with the sink) per head, in double.
std::vector<int64_t> selected(const Data& d, int64_t i, int64_t g) {
  std::vector<int64_t> out;
  for (int64_t e = 0; e < K; ++e) {
    const int64_t b = d.idx[(i * N2 + g) * K + e];
    if (b < 0) continue;
    for (int64_t j = b * BS; j < std::min((b + 1) * BS, S); ++j) {
      if (j <= i) out.push_back(j);
    }
  }
  return out;
}

double score(const Data& d, int64_t i, int64_t h, int64_t j) {
  const int64_t g = h / G;
  double s = 0;
  for (int64_t e = 0; e < D; ++e)
    s += double(d.q[(i * N1 + h) * D + e]) * d.k[(j * N2 + g) * D + e];
  for (int64_t e = 0; e < DR; ++e) {
    s += double(d.qr[(i * N1 + h) * DR + e]) * d.kr[(j * N2 + g) * DR + e];
  }
  return 0.4 * s;
}

struct Reference {
  std::vector<double> out, dq, dk, dv, dqr, dkr, dsinks;
};

Reference reference(const Data& d) {
  Reference r;
  r.out.assign(S * N1 * DV, 0);
  r.dq.assign(S * N1 * D, 0);
  r.dqr.assign(S * N1 * DR, 0);
  r.dk.assign(S * N2 * D, 0);
  r.dkr.assign(S * N2 * DR, 0);
  r.dv.assign(S * N2 * DV, 0);
  r.dsinks.assign(N1, 0);
  for (int64_t i = 0; i < S; ++i) {
    for (int64_t h = 0; h < N1; ++h) {
      const int64_t g = h / G;
      const std::vector<int64_t> keys = selected(d, i, g);
      if (keys.empty()) continue;
      std::vector<double> p;
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j : keys) m = std::max(m, score(d, i, h, j));
      double z = std::exp(double(d.sinks[h]) - m);
      for (int64_t j : keys) z += std::exp(score(d, i, h, j) - m);
      for (int64_t j : keys) p.push_back(std::exp(score(d, i, h, j) - m) / z);
      const double psink = std::exp(double(d.sinks[h]) - m) / z;
      const float* dout = d.dout.data() + (i * N1 + h) * DV;
      double delta = 0;
      for (size_t c = 0; c < keys.size(); ++c) {
        for (int64_t e = 0; e < DV; ++e) {
          r.out[(i * N1 + h) * DV + e] += p[c] * d.v[(keys[c] * N2 + g) * DV + e];
        }
      }
      for (int64_t e = 0; e < DV; ++e) delta += double(dout[e]) * r.out[(i * N1 + h) * DV + e];
      r.dsinks[h] += -psink * delta;
      for (size_t c = 0; c < keys.size(); ++c) {
        const int64_t j = keys[c];
        double dp = 0;
        for (int64_t e = 0; e < DV; ++e) {
          dp += double(dout[e]) * d.v[(j * N2 + g) * DV + e];
          r.dv[(j * N2 + g) * DV + e] += p[c] * dout[e];
        }
        const double ds = 0.4 * p[c] * (dp - delta);
        for (int64_t e = 0; e < D; ++e) {
          r.dq[(i * N1 + h) * D + e] += ds * d.k[(j * N2 + g) * D + e];
          r.dk[(j * N2 + g) * D + e] += ds * d.q[(i * N1 + h) * D + e];
        }
        for (int64_t e = 0; e < DR; ++e) {
          r.dqr[(i * N1 + h) * DR + e] += ds * d.kr[(j * N2 + g) * DR + e];
          r.dkr[(j * N2 + g) * DR + e] += ds * d.qr[(i * N1 + h) * DR + e];
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
  std::vector<float> dq, dk, dv, dqr, dkr, dsinks;
};

Grads run_backward(const Data& d, const SparseAttentionParams& p, const std::vector<float>& out,
                   const std::vector<float>& m, const std::vector<float>& l, int workers, Isa isa) {
  Grads g{std::vector<float>(S * N1 * D),  std::vector<float>(S * N2 * D),
          std::vector<float>(S * N2 * DV), std::vector<float>(S * N1 * DR),
          std::vector<float>(S * N2 * DR), std::vector<float>(N1)};
  SparseAttentionGrads gr;
  gr.dout = View{d.dout.data(), p.out.sb, p.out.ss, p.out.sn, p.out.sd};
  gr.out = View{out.data(), p.out.sb, p.out.ss, p.out.sn, p.out.sd};
  gr.softmax_max = m.data();
  gr.softmax_sum = l.data();
  gr.dq = g.dq.data();
  gr.dk = g.dk.data();
  gr.dv = g.dv.data();
  gr.dq_rope = g.dqr.data();
  gr.dk_rope = g.dkr.data();
  gr.dsinks = g.dsinks.data();
  sparse_flash_attention_backward(p, gr, ThreadExecutor(workers), isa);
  return g;
}

TEST(SparseAttentionCore, ForwardAndBackwardMatchTheFormulasOnEveryLevel) {
  const Data d = make_data();
  const Reference r = reference(d);
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(isa_name(isa));
    std::vector<float> out, m, l;
    const SparseAttentionParams p = make_params(d, out, m, l);
    sparse_flash_attention(p, ThreadExecutor(3), isa);
    expect_near(out, r.out, 2e-5, "out");
    const Grads g = run_backward(d, p, out, m, l, 3, isa);
    expect_near(g.dq, r.dq, 1e-4, "dq");
    expect_near(g.dk, r.dk, 1e-4, "dk");
    expect_near(g.dv, r.dv, 1e-4, "dv");
    expect_near(g.dqr, r.dqr, 1e-4, "dq_rope");
    expect_near(g.dkr, r.dkr, 1e-4, "dk_rope");
    expect_near(g.dsinks, r.dsinks, 1e-4, "dsinks");
  }
}

TEST(SparseAttentionCore, SameBitsWhateverTheWorkerCount) {
  const Data d = make_data();
  std::vector<float> out1, m1, l1, out5, m5, l5;
  const SparseAttentionParams p1 = make_params(d, out1, m1, l1);
  const SparseAttentionParams p5 = make_params(d, out5, m5, l5);
  sparse_flash_attention(p1, ThreadExecutor(1), detected_isa());
  sparse_flash_attention(p5, ThreadExecutor(5), detected_isa());
  EXPECT_EQ(out1, out5);
  const Grads a = run_backward(d, p1, out1, m1, l1, 1, detected_isa());
  const Grads b = run_backward(d, p5, out5, m5, l5, 5, detected_isa());
  EXPECT_EQ(a.dq, b.dq);
  EXPECT_EQ(a.dk, b.dk);
  EXPECT_EQ(a.dv, b.dv);
  EXPECT_EQ(a.dsinks, b.dsinks);
}

TEST(SparseAttentionCore, BadIndicesNameTheRow) {
  Data d = make_data();
  std::vector<float> out, m, l;
  for (int32_t bad : {-2, static_cast<int32_t>((S + BS - 1) / BS)}) {
    Data copy = d;
    copy.idx[(3 * N2 + 1) * K + 2] = bad;
    const SparseAttentionParams p = make_params(copy, out, m, l);
    try {
      sparse_flash_attention(p, SerialExecutor(), Isa::kScalar);
      ADD_FAILURE() << "no error for " << bad;
    } catch (const ArgumentError& e) {
      EXPECT_EQ(std::string(e.what()).rfind("sparse_indices: row [0, 3, 1]", 0), 0u) << e.what();
    }
  }
  d.idx[(3 * N2 + 1) * K + 1] = d.idx[(3 * N2 + 1) * K + 0];
  const SparseAttentionParams p = make_params(d, out, m, l);
  EXPECT_THROW(sparse_flash_attention(p, SerialExecutor(), Isa::kScalar), ArgumentError);
}

}  // namespace
}  // namespace opmesh::core
