// The compressor against a double-precision reference on every supported instruction set (both
// coff, a ratio that does not divide the length, a start read from a ring state), its gradients
// against finite differences of that reference, empty calls with null pointers, and the checks
// that name an argument.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "compressor/compressor.h"
#include "cpu_features.h"
#include "errors.h"
#include "thread_executor.h"

namespace opmesh::core {
namespace {

struct Problem {
  int64_t batch = 2, seq = 11, hidden = 7, dim = 5, coff = 2, ratio = 3;
  std::vector<float> x, wkv, wgate, ape, out;
  std::vector<float> state;  // [blocks][block_size][2 coff D]
  std::vector<int64_t> table, start;
  int64_t blocks = 4, block_size = 8;

  explicit Problem(int64_t coff_, bool with_state) : coff(coff_) {
    std::mt19937 rng(7);
    std::normal_distribution<float> n(0.0f, 1.0f);
    auto fill = [&](std::vector<float>& v, int64_t size) {
      v.resize(static_cast<size_t>(size));
      for (float& e : v) e = n(rng);
    };
    const int64_t w = coff * dim;
    fill(x, batch * seq * hidden);
    fill(wkv, w * hidden);
    fill(wgate, w * hidden);
    fill(ape, ratio * w);
    out.assign(static_cast<size_t>(batch * out_rows() * dim), -1.0f);
    if (with_state) {
      fill(state, blocks * block_size * 2 * w);
      table = {1, 3};  // a ring per sequence
      start = {4, 0};
    }
  }
  int64_t out_rows() const { return (seq + ratio - 1) / ratio; }

  CompressorParams params() {
    CompressorParams p;
    p.batch = batch;
    p.seq_len = seq;
    p.tokens = batch * seq;
    p.hidden = hidden;
    p.dim = dim;
    p.coff = coff;
    p.cmp_ratio = ratio;
    p.x = View{x.data(), seq * hidden, hidden, 0, 1};
    p.wkv = View{wkv.data(), 0, hidden, 0, 1};
    p.wgate = View{wgate.data(), 0, hidden, 0, 1};
    p.ape = View{ape.data(), 0, coff * dim, 0, 1};
    p.cmp_kv = MutableView{out.data(), out_rows() * dim, dim, 0, 1};
    p.out_rows = out_rows();
    if (!state.empty()) {
      p.has_state = true;
      p.cache_mode = 2;
      p.state = MutableView{state.data(), block_size * 2 * coff * dim, 2 * coff * dim, 0, 1};
      p.num_blocks = blocks;
      p.block_size = block_size;
      p.block_table = table.data();
      p.table_width = 1;
      p.start_pos = start.data();
    }
    return p;
  }

  // Entry w of sequence b in double precision (history from the state as it was).
  std::vector<double> entry(int64_t b, int64_t w, const std::vector<float>& old_state) const {
    const int64_t wd = coff * dim, s0 = start.empty() ? 0 : start[b];
    auto row = [&](int64_t pos, std::vector<double>& kv, std::vector<double>& sc) {
      kv.assign(static_cast<size_t>(wd), 0.0);
      sc.assign(static_cast<size_t>(wd), 0.0);
      if (pos < s0) {
        const float* r =
            old_state.data() + table[b] * block_size * 2 * wd + (pos % block_size) * 2 * wd;
        for (int64_t c = 0; c < wd; ++c) kv[c] = r[c], sc[c] = r[wd + c];
        return;
      }
      const float* xr = x.data() + (b * seq + pos - s0) * hidden;
      for (int64_t c = 0; c < wd; ++c) {
        for (int64_t h = 0; h < hidden; ++h) {
          kv[c] += double(wkv[c * hidden + h]) * xr[h];
          sc[c] += double(wgate[c * hidden + h]) * xr[h];
        }
        sc[c] += ape[(pos % ratio) * wd + c];
      }
    };
    std::vector<std::pair<int64_t, int64_t>> slots;  // (position, channel offset)
    if (coff == 2 && w >= 1) {
      for (int64_t j = 0; j < ratio; ++j) slots.push_back({(w - 1) * ratio + j, 0});
    }
    for (int64_t j = 0; j < ratio; ++j) slots.push_back({w * ratio + j, coff == 2 ? dim : 0});
    std::vector<double> res(static_cast<size_t>(dim));
    for (int64_t c = 0; c < dim; ++c) {
      double m = -INFINITY, l = 0.0, acc = 0.0;
      std::vector<double> kv, sc;
      for (auto [pos, off] : slots) {
        row(pos, kv, sc);
        m = std::max(m, sc[off + c]);
      }
      for (auto [pos, off] : slots) {
        row(pos, kv, sc);
        const double e = std::exp(sc[off + c] - m);
        l += e;
        acc += e * kv[off + c];
      }
      res[c] = acc / l;
    }
    return res;
  }
};

void expect_matches_reference(Problem& pr, Isa isa) {
  const std::vector<float> old_state = pr.state;
  compressor(pr.params(), ThreadExecutor(3), isa);
  for (int64_t b = 0; b < pr.batch; ++b) {
    const int64_t s0 = pr.start.empty() ? 0 : pr.start[b];
    const int64_t first = s0 / pr.ratio, count = (s0 + pr.seq) / pr.ratio - first;
    for (int64_t e = 0; e < pr.out_rows(); ++e) {
      for (int64_t c = 0; c < pr.dim; ++c) {
        const float got = pr.out[(b * pr.out_rows() + e) * pr.dim + c];
        if (e >= count) {
          EXPECT_EQ(got, 0.0f) << "padding row " << e;
          continue;
        }
        const double want = pr.entry(b, first + e, old_state)[c];
        EXPECT_NEAR(got, want, 2e-5 * (1.0 + std::fabs(want)))
            << isa_name(isa) << " b " << b << " entry " << e << " c " << c;
      }
    }
  }
}

TEST(Compressor, MatchesDoubleReferenceOnEveryInstructionSet) {
  for (Isa isa : supported_isas()) {
    for (int64_t coff : {1, 2}) {
      Problem pr(coff, false);
      expect_matches_reference(pr, isa);
    }
  }
}

TEST(Compressor, ReadsEarlierPositionsFromARingState) {
  for (Isa isa : supported_isas()) {
    Problem pr(2, true);
    expect_matches_reference(pr, isa);
    // The call's own tokens are now in the ring: sequence 1's last position 10 in slot 2.
    const int64_t wd = 2 * pr.dim;
    const float* stored = pr.state.data() + (3 * pr.block_size + 10 % pr.block_size) * 2 * wd;
    double kv0 = 0.0;
    for (int64_t h = 0; h < pr.hidden; ++h) {
      kv0 += double(pr.wkv[h]) * pr.x[(1 * pr.seq + 10) * pr.hidden + h];
    }
    EXPECT_NEAR(stored[0], kv0, 1e-5);
  }
}

// Gradients against central differences of the double reference (loss = sum g * out).
TEST(Compressor, BackwardMatchesFiniteDifferences) {
  Problem pr(2, false);
  pr.seq = 7;
  pr.x.resize(static_cast<size_t>(pr.batch * pr.seq * pr.hidden));
  pr.out.assign(static_cast<size_t>(pr.batch * pr.out_rows() * pr.dim), 0.0f);
  std::vector<float> g(pr.out.size());
  for (size_t i = 0; i < g.size(); ++i) g[i] = std::sin(0.37 * double(i) + 0.1);
  auto loss = [&]() {
    double s = 0.0;
    for (int64_t b = 0; b < pr.batch; ++b) {
      for (int64_t e = 0; e < pr.seq / pr.ratio; ++e) {
        const std::vector<double> v = pr.entry(b, e, {});
        for (int64_t c = 0; c < pr.dim; ++c) s += g[(b * pr.out_rows() + e) * pr.dim + c] * v[c];
      }
    }
    return s;
  };
  std::vector<float> dx(pr.x.size()), dwkv(pr.wkv.size()), dwgate(pr.wgate.size()),
      dape(pr.ape.size());
  const CompressorParams p = pr.params();
  CompressorGrads grads;
  grads.d_cmp_kv = View{g.data(), pr.out_rows() * pr.dim, pr.dim, 0, 1};
  grads.dx = MutableView{dx.data(), pr.seq * pr.hidden, pr.hidden, 0, 1};
  grads.dwkv = MutableView{dwkv.data(), 0, pr.hidden, 0, 1};
  grads.dwgate = MutableView{dwgate.data(), 0, pr.hidden, 0, 1};
  grads.dape = MutableView{dape.data(), 0, 2 * pr.dim, 0, 1};
  for (Isa isa : supported_isas()) {
    compressor_backward(p, grads, ThreadExecutor(2), isa);
    for (auto [values, grad] : {std::pair{&pr.x, &dx}, std::pair{&pr.wkv, &dwkv},
                                std::pair{&pr.wgate, &dwgate}, std::pair{&pr.ape, &dape}}) {
      for (size_t i = 0; i < values->size(); i += 3) {
        const float keep = (*values)[i];
        (*values)[i] = keep + 1e-2f;
        const double up = loss();
        (*values)[i] = keep - 1e-2f;
        const double down = loss();
        (*values)[i] = keep;
        const double want = (up - down) / (2 * 1e-2);
        EXPECT_NEAR((*grad)[i], want, 2e-3 * (1.0 + std::fabs(want))) << isa_name(isa) << " " << i;
      }
    }
  }
}

TEST(Compressor, EmptyCallsNeedNoPointers) {
  CompressorParams p;
  p.batch = 0;
  p.coff = 1;
  p.cmp_ratio = 4;
  p.hidden = 8;
  p.dim = 4;
  compressor(p, ThreadExecutor(2), Isa::kScalar);
  std::vector<float> state(2 * 4 * 8, 1.0f);  // a state cache, and no sequence to read it
  p.has_state = true;
  p.num_blocks = 2;
  p.block_size = 4;
  p.state = MutableView{state.data(), 4 * 8, 8, 0, 1};
  compressor(p, ThreadExecutor(2), Isa::kScalar);
  EXPECT_EQ(std::count(state.begin(), state.end(), 1.0f), 64);
  p.has_state = false;
  p.batch = 2;  // two sequences of no tokens
  p.out_rows = 0;
  compressor(p, ThreadExecutor(2), Isa::kScalar);
}

std::string argument_of(const CompressorParams& p) {
  try {
    compressor(p, ThreadExecutor(1), Isa::kScalar);
  } catch (const ArgumentError& e) {
    return e.argument();
  }
  return "";
}

TEST(Compressor, ErrorsNameTheArgument) {
  Problem pr(2, true);
  CompressorParams p = pr.params();
  EXPECT_EQ(argument_of([&] {
              auto q = p;
              q.coff = 3;
              return q;
            }()),
            "coff");
  EXPECT_EQ(argument_of([&] {
              auto q = p;
              q.cmp_ratio = 0;
              return q;
            }()),
            "cmp_ratio");
  EXPECT_EQ(argument_of([&] {
              auto q = p;
              q.cache_mode = 0;
              return q;
            }()),
            "cache_mode");
  EXPECT_EQ(argument_of([&] {
              auto q = p;
              q.block_size = 5;
              return q;
            }()),
            "state_cache");
  EXPECT_EQ(argument_of([&] {
              auto q = p;
              q.block_table = nullptr;
              return q;
            }()),
            "state_block_table");
  std::vector<int64_t> zero_table = {0, 3};
  EXPECT_EQ(argument_of([&] {
              auto q = p;
              q.block_table = zero_table.data();
              return q;
            }()),
            "state_block_table");
  std::vector<int64_t> far_start = {-1, 0};
  EXPECT_EQ(argument_of([&] {
              auto q = p;
              q.start_pos = far_start.data();
              return q;
            }()),
            "start_pos");
  std::vector<int64_t> used = {12, 0};
  EXPECT_EQ(argument_of([&] {
              auto q = p;
              q.seqused = used.data();
              return q;
            }()),
            "seqused");
  EXPECT_EQ(argument_of([&] {
              auto q = p;
              q.has_state = false;
              return q;
            }()),
            "start_pos");
  EXPECT_EQ(argument_of([&] {
              auto q = p;
              q.out_rows = 1;
              return q;
            }()),
            "cmp_kv");
}

}  // namespace
}  // namespace opmesh::core
