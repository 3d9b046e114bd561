// The flash-attention kernel of the core against a double-precision reference written from the
// definition, on every instruction set this machine has, with plans for several worker counts
// (so split units and combine tasks run), real threads, and deterministic mode. Also run under
// AddressSanitizer + UBSan by `make test-asan`.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "attention/flash_attn.h"
#include "attention/planner.h"
#include "errors.h"
#include "thread_executor.h"

namespace opmesh::core::attention {
namespace {

constexpr int kHeadsQ = 8, kHeadsKv = 2, kDim = 40, kDimV = 24;

struct Batch {
  std::vector<int32_t> cu;
  std::vector<float> q, k, v, sinks;
};

Batch make_batch(const std::vector<int32_t>& lengths, uint32_t seed) {
  Batch b;
  b.cu = {0};
  for (int32_t n : lengths) b.cu.push_back(b.cu.back() + n);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  auto fill = [&](std::vector<float>& x, size_t n) {
    x.resize(n);
    for (float& e : x) e = normal(rng);
  };
  fill(b.q, static_cast<size_t>(b.cu.back()) * kHeadsQ * kDim);
  fill(b.k, static_cast<size_t>(b.cu.back()) * kHeadsKv * kDim);
  fill(b.v, static_cast<size_t>(b.cu.back()) * kHeadsKv * kDimV);
  fill(b.sinks, kHeadsQ);
  return b;
}

// Output [T][Nq][Dv] and lse [Nq][T] in double, from the definition.
void reference(const Batch& x, const PlanConfig& c, bool sinks, std::vector<double>& out,
               std::vector<double>& lse) {
  const int64_t total = x.cu.back();
  out.assign(total * kHeadsQ * kDimV, 0.0);
  lse.assign(kHeadsQ * total, std::numeric_limits<double>::infinity());
  const double scale = 1.0 / std::sqrt(static_cast<double>(kDim));
  for (size_t b = 0; b + 1 < x.cu.size(); ++b) {
    const int64_t start = x.cu[b], n = x.cu[b + 1] - x.cu[b];
    for (int64_t i = 0; i < n; ++i) {
      for (int h = 0; h < kHeadsQ; ++h) {
        const int g = h / (kHeadsQ / kHeadsKv);
        std::vector<double> s;
        std::vector<int64_t> keys;
        for (int64_t j = 0; j < n; ++j) {
          bool visible = true;
          if (c.mask_mode == MaskMode::kCausal) visible = j <= i;
          if (c.mask_mode == MaskMode::kWindow) {
            visible = (c.win_left < 0 || j >= i - c.win_left) &&
                      (c.win_right < 0 || j <= i + c.win_right);
          }
          if (!visible) continue;
          double dot = 0;
          for (int d = 0; d < kDim; ++d) {
            dot += static_cast<double>(x.q[((start + i) * kHeadsQ + h) * kDim + d]) *
                   x.k[((start + j) * kHeadsKv + g) * kDim + d];
          }
          s.push_back(dot * scale);
          keys.push_back(j);
        }
        double m = sinks ? x.sinks[h] : -std::numeric_limits<double>::infinity();
        for (double e : s) m = std::max(m, e);
        if (s.empty() && !sinks) continue;
        double l = sinks ? std::exp(x.sinks[h] - m) : 0.0;
        for (double e : s) l += std::exp(e - m);
        for (size_t t = 0; t < s.size(); ++t) {
          const double p = std::exp(s[t] - m) / l;
          for (int e = 0; e < kDimV; ++e) {
            out[((start + i) * kHeadsQ + h) * kDimV + e] +=
                p * x.v[((start + keys[t]) * kHeadsKv + g) * kDimV + e];
          }
        }
        lse[h * total + start + i] = m + std::log(l);
      }
    }
  }
}

// The params of a float32 TND call on batch `x` with lengths `arrays`, writing `out` and `lse`
// (sized for the batch's query tokens).
FlashAttnParams tnd_params(const PlanConfig& c, const Batch& x, const LengthArrays& arrays,
                           std::vector<float>& out, std::vector<float>& lse) {
  const int64_t total = x.cu.back();
  out.resize(total * kHeadsQ * kDimV);
  lse.resize(kHeadsQ * total);
  FlashAttnParams p;
  p.config = c;
  p.lengths = arrays;
  p.dtype = DType::kFloat32;
  p.q = {x.q.data(), 0, kHeadsQ * kDim, kDim, 1};
  p.k = {x.k.data(), 0, kHeadsKv * kDim, kDim, 1};
  p.v = {x.v.data(), 0, kHeadsKv * kDimV, kDimV, 1};
  p.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(kDim)));
  p.out.data = out.data();
  p.out.ss = kHeadsQ * kDimV;
  p.out.sn = kDimV;
  p.out.sd = 1;
  p.lse = lse.data();
  p.lse_sn = total;
  p.lse_ss = 1;
  return p;
}

void run_and_check(const PlanConfig& c, bool sinks, Isa isa, int threads,
                   const Plan* given_plan = nullptr, const Executor* executor = nullptr,
                   std::vector<int64_t>* busy_ns = nullptr) {
  const std::vector<int32_t> lengths{130, 0, 1, 1100, 67};
  const Batch x = make_batch(lengths, 3);
  const LengthArrays arrays{x.cu.data(), x.cu.data(), nullptr, nullptr};
  const std::vector<Sequence> seqs = resolve_sequences(c, arrays);
  const Plan plan = given_plan != nullptr ? *given_plan : make_plan(c, seqs);
  // No padding rows here: the kernel must write every element, so start from NaN.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> out(x.cu.back() * kHeadsQ * kDimV, nan), lse(kHeadsQ * x.cu.back(), nan);
  FlashAttnParams p = tnd_params(c, x, arrays, out, lse);
  p.sinks = sinks ? x.sinks.data() : nullptr;
  std::vector<float> workspace(std::max<int64_t>(1, workspace_floats(c, plan)));
  std::vector<int64_t> busy(plan.workers.size(), -1);
  const ThreadExecutor own(threads);
  flash_attn(p, seqs, plan, executor != nullptr ? *executor : own, isa, workspace.data(),
             busy.data());
  if (busy_ns != nullptr) *busy_ns = busy;
  // The reference depends on the mask and the sinks only: compute it once per combination.
  static std::map<std::string, std::pair<std::vector<double>, std::vector<double>>> cache;
  const std::string key = std::to_string(static_cast<int>(c.mask_mode)) + "/" +
                          std::to_string(c.win_left) + "/" + std::to_string(c.win_right) + "/" +
                          std::to_string(sinks);
  if (cache.find(key) == cache.end()) reference(x, c, sinks, cache[key].first, cache[key].second);
  const std::vector<double>& want_out = cache[key].first;
  const std::vector<double>& want_lse = cache[key].second;
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_NEAR(out[i], want_out[i], 2e-5) << "output element " << i;
  }
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(want_lse[i])) {
      ASSERT_TRUE(std::isinf(lse[i]) && lse[i] > 0) << "lse " << i;
    } else {
      ASSERT_NEAR(lse[i], want_lse[i], 2e-5) << "lse " << i;
    }
  }
}

PlanConfig config(MaskMode mode, int64_t workers, bool deterministic) {
  PlanConfig c;
  c.num_heads_q = kHeadsQ;
  c.num_heads_kv = kHeadsKv;
  c.head_dim = kDim;
  c.head_dim_v = kDimV;
  c.batch_size = 5;
  c.max_seqlen_q = c.max_seqlen_kv = 1100;
  c.mask_mode = mode;
  c.layout_q = c.layout_kv = c.layout_out = Layout::kTND;
  c.num_workers = workers;
  c.deterministic = deterministic;
  return c;
}

TEST(FlashAttnCore, MatchesDoubleReferenceOnEveryIsaAndPlan) {
  for (Isa isa : supported_isas()) {
    for (int64_t workers : {1, 7, 40}) {
      SCOPED_TRACE(std::string(isa_name(isa)) + " workers " + std::to_string(workers));
      run_and_check(config(MaskMode::kCausal, workers, false), false, isa, 3);
    }
  }
}

TEST(FlashAttnCore, WindowsSinksAndDeterministicSplits) {
  const Isa isa = detected_isa();
  PlanConfig window = config(MaskMode::kWindow, 9, false);
  window.win_left = 100;
  window.win_right = 3;
  run_and_check(window, true, isa, 2);
  run_and_check(config(MaskMode::kNone, 5, true), true, isa, 2);
  run_and_check(config(MaskMode::kCausal, 64, true), false, isa, 4);
}

// A plan whose work all lies in one worker's stretch runs it on the calling thread: no parallel
// region starts (a short decode), the idle workers report no busy time, and the results are the
// same as from threads.
TEST(FlashAttnCore, OneBusyWorkerRunsWithoutParallelRegion) {
  const PlanConfig one = config(MaskMode::kCausal, 1, false);
  const std::vector<int32_t> lengths{130, 0, 1, 1100, 67};
  const Batch x = make_batch(lengths, 3);
  const LengthArrays arrays{x.cu.data(), x.cu.data(), nullptr, nullptr};
  const std::vector<Sequence> seqs = resolve_sequences(one, arrays);
  Plan plan = make_plan(one, seqs);
  ASSERT_EQ(plan.workers.size(), 1u);
  const Position end = plan.workers[0].end;
  plan.workers.resize(4, WorkerRange{end, end, -1, -1, 0.0f});  // three idle workers
  const PlanConfig four = config(MaskMode::kCausal, 4, false);
  const CountingExecutor counting(4);
  std::vector<int64_t> busy;
  run_and_check(four, false, detected_isa(), 4, &plan, &counting, &busy);
  EXPECT_EQ(counting.regions, 0);
  EXPECT_GT(busy[0], 0);
  for (size_t w = 1; w < busy.size(); ++w) EXPECT_EQ(busy[w], 0) << "worker " << w;
  // The planner's own plan for four workers keeps them busy side by side: one region.
  const CountingExecutor planned(4);
  run_and_check(four, false, detected_isa(), 4, nullptr, &planned, &busy);
  EXPECT_GE(planned.regions, 1);
  for (int64_t ns : busy) EXPECT_GT(ns, 0);
}

TEST(FlashAttnCore, EntryPointValidatesWhatItIsGiven) {
  const PlanConfig c = config(MaskMode::kCausal, 2, false);
  const std::vector<int32_t> lengths{130, 0, 1, 1100, 67};
  const Batch x = make_batch(lengths, 3);
  const LengthArrays arrays{x.cu.data(), x.cu.data(), nullptr, nullptr};
  const std::vector<Sequence> seqs = resolve_sequences(c, arrays);
  const Plan plan = make_plan(c, seqs);
  std::vector<float> out(x.cu.back() * kHeadsQ * kDimV);
  std::vector<float> workspace(std::max<int64_t>(1, workspace_floats(c, plan)));
  FlashAttnParams good;
  good.config = c;
  good.lengths = arrays;
  good.q = {x.q.data(), 0, kHeadsQ * kDim, kDim, 1};
  good.k = {x.k.data(), 0, kHeadsKv * kDim, kDim, 1};
  good.v = {x.v.data(), 0, kHeadsKv * kDimV, kDimV, 1};
  good.out.data = out.data();
  good.out.ss = kHeadsQ * kDimV;
  good.out.sn = kDimV;
  good.out.sd = 1;
  good.softmax_scale = 0.1f;
  const SerialExecutor serial;
  auto expect_arg = [&](const FlashAttnParams& p, const std::vector<Sequence>& s, const Plan& pl,
                        float* ws, const std::string& arg) {
    try {
      flash_attn(p, s, pl, serial, Isa::kScalar, ws, nullptr);
      ADD_FAILURE() << "no error for " << arg;
    } catch (const ArgumentError& e) {
      EXPECT_EQ(e.argument(), arg) << e.what();
    }
  };
  FlashAttnParams bad = good;
  bad.config.num_heads_kv = 3;
  expect_arg(bad, seqs, plan, workspace.data(), "num_heads_kv");
  bad = good;
  bad.q.data = nullptr;
  expect_arg(bad, seqs, plan, workspace.data(), "q");
  bad = good;
  bad.softmax_scale = std::numeric_limits<float>::infinity();
  expect_arg(bad, seqs, plan, workspace.data(), "softmax_scale");
  std::vector<Sequence> fewer(seqs.begin(), seqs.end() - 1);
  expect_arg(good, fewer, plan, workspace.data(), "sequences");
  std::vector<Sequence> longer = seqs;
  longer[0].q_len = c.max_seqlen_q + 1;
  expect_arg(good, longer, plan, workspace.data(), "sequences");
  Plan short_plan = plan;
  short_plan.workers.pop_back();
  expect_arg(good, seqs, short_plan, workspace.data(), "plan");
  if (plan.num_slots > 0) expect_arg(good, seqs, plan, nullptr, "workspace");
}

// An empty tensor may have no buffer: with no keys in any sequence, null k and v are accepted
// and every query row comes out 0 with lse +inf; with no queries, q and out may be null too.
TEST(FlashAttnCore, EmptyOperandsNeedNoBuffer) {
  const PlanConfig c = config(MaskMode::kCausal, 2, false);
  const std::vector<int32_t> q_lengths{5, 0, 3, 0, 2};  // config() plans 5 sequences
  const Batch x = make_batch(q_lengths, 4);
  const std::vector<int32_t> no_keys(x.cu.size(), 0);
  const LengthArrays arrays{x.cu.data(), no_keys.data(), nullptr, nullptr};
  const std::vector<Sequence> seqs = resolve_sequences(c, arrays);
  const Plan plan = make_plan(c, seqs);
  const int64_t rows = x.cu.back();
  std::vector<float> out(rows * kHeadsQ * kDimV, 7.0f), lse(kHeadsQ * rows, 7.0f);
  std::vector<float> workspace(std::max<int64_t>(1, workspace_floats(c, plan)));
  FlashAttnParams p = tnd_params(c, x, arrays, out, lse);
  p.k.data = nullptr;
  p.v.data = nullptr;
  const SerialExecutor serial;
  flash_attn(p, seqs, plan, serial, Isa::kScalar, workspace.data(), nullptr);
  for (float o : out) EXPECT_EQ(o, 0.0f);
  for (float l : lse) EXPECT_EQ(l, std::numeric_limits<float>::infinity());

  const std::vector<int32_t> none(x.cu.size(), 0);
  const LengthArrays empty_arrays{none.data(), none.data(), nullptr, nullptr};
  const std::vector<Sequence> empty = resolve_sequences(c, empty_arrays);
  FlashAttnParams nothing = p;
  nothing.lengths = empty_arrays;
  nothing.q.data = nullptr;
  nothing.out.data = nullptr;
  nothing.lse = nullptr;
  flash_attn(nothing, empty, make_plan(c, empty), serial, Isa::kScalar, workspace.data(), nullptr);
}

}  // namespace
}  // namespace opmesh::core::attention
