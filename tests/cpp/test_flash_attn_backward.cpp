// The backward kernel against gradients derived here in float64 from the definition of the
// forward (explicit scores, softmax with the sink, output), on varlen batches with empty
// sequences, GQA, every mask, windows and sinks, several worker counts.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention/flash_attn.h"
#include "attention/flash_attn_backward.h"
#include "attention/planner.h"
#include "dtype.h"
#include "errors.h"
#include "thread_executor.h"

namespace opmesh::core::attention {
namespace {

constexpr int64_t kHq = 4, kHkv = 2, kD = 40, kDv = 24;

struct Problem {
  PlanConfig c;
  std::vector<int32_t> cu;
  std::vector<float> q, k, v, dout, sinks, dlse;  // dlse [Hq][T] or empty
  float softcap = 0.0f;
  std::vector<float> slopes;  // ALiBi, [Hq] or empty
};

Problem make(MaskMode mode, int64_t left, int64_t right, const std::vector<int32_t>& lengths,
             bool sinks, unsigned seed) {
  Problem x;
  x.c.num_heads_q = kHq;
  x.c.num_heads_kv = kHkv;
  x.c.head_dim = kD;
  x.c.head_dim_v = kDv;
  x.c.batch_size = static_cast<int64_t>(lengths.size());
  x.c.mask_mode = mode;
  x.c.win_left = left;
  x.c.win_right = right;
  x.c.layout_q = x.c.layout_kv = x.c.layout_out = Layout::kTND;
  x.cu.push_back(0);
  int32_t longest = 0;
  for (int32_t n : lengths) {
    x.cu.push_back(x.cu.back() + n);
    longest = std::max(longest, n);
  }
  x.c.max_seqlen_q = x.c.max_seqlen_kv = std::max(1, longest);
  const int64_t t = x.cu.back();
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto fill = [&](std::vector<float>& a, int64_t n) {
    a.resize(n);
    for (auto& e : a) e = nd(rng);
  };
  fill(x.q, t * kHq * kD);
  fill(x.k, t * kHkv * kD);
  fill(x.v, t * kHkv * kDv);
  fill(x.dout, t * kHq * kDv);
  if (sinks) fill(x.sinks, kHq);
  return x;
}

// Gradients from the definition, in float64.
void reference(const Problem& x, float scale, std::vector<double>& dq, std::vector<double>& dk,
               std::vector<double>& dv, std::vector<double>& dsinks) {
  const int64_t t = x.cu.back();
  dq.assign(t * kHq * kD, 0.0);
  dk.assign(t * kHkv * kD, 0.0);
  dv.assign(t * kHkv * kDv, 0.0);
  dsinks.assign(kHq, 0.0);
  const Mask mask = mask_of(x.c);
  for (size_t b = 0; b + 1 < x.cu.size(); ++b) {
    const int64_t t0 = x.cu[b], n = x.cu[b + 1] - x.cu[b];
    const Sequence seq{t0, n, t0, n, static_cast<int64_t>(b)};
    for (int64_t h = 0; h < kHq; ++h) {
      const int64_t g = h / (kHq / kHkv);
      for (int64_t i = 0; i < n; ++i) {
        const KeyRange vr = visible_keys(mask, seq, i);
        const double* none = nullptr;
        (void)none;
        std::vector<double> s(n, -std::numeric_limits<double>::infinity());
        double top = x.sinks.empty() ? -std::numeric_limits<double>::infinity() : x.sinks[h];
        for (int64_t j = vr.begin; j < vr.end; ++j) {
          double dot = 0;
          for (int64_t e = 0; e < kD; ++e)
            dot += double(x.q[((t0 + i) * kHq + h) * kD + e]) * x.k[((t0 + j) * kHkv + g) * kD + e];
          s[j] = scale * dot;
          if (x.softcap > 0.0f) s[j] = x.softcap * std::tanh(s[j] / x.softcap);
          if (!x.slopes.empty()) s[j] -= x.slopes[h] * std::abs(double(i - j));
          top = std::max(top, s[j]);
        }
        if (top == -std::numeric_limits<double>::infinity()) continue;
        double total = x.sinks.empty() ? 0.0 : std::exp(x.sinks[h] - top);
        for (int64_t j = vr.begin; j < vr.end; ++j) total += std::exp(s[j] - top);
        std::vector<double> p(n, 0.0), out(kDv, 0.0);
        for (int64_t j = vr.begin; j < vr.end; ++j) {
          p[j] = std::exp(s[j] - top) / total;
          for (int64_t e = 0; e < kDv; ++e) out[e] += p[j] * x.v[((t0 + j) * kHkv + g) * kDv + e];
        }
        const float* go = x.dout.data() + ((t0 + i) * kHq + h) * kDv;
        double delta = 0;
        for (int64_t e = 0; e < kDv; ++e) delta += go[e] * out[e];
        if (!x.dlse.empty()) delta -= x.dlse[h * x.cu.back() + t0 + i];
        if (!x.sinks.empty()) dsinks[h] -= std::exp(x.sinks[h] - top) / total * delta;
        for (int64_t j = vr.begin; j < vr.end; ++j) {
          double dp = 0;
          for (int64_t e = 0; e < kDv; ++e) {
            dp += go[e] * double(x.v[((t0 + j) * kHkv + g) * kDv + e]);
            dv[((t0 + j) * kHkv + g) * kDv + e] += p[j] * go[e];
          }
          double ds = p[j] * (dp - delta);
          if (x.softcap > 0.0f) {
            double dot = 0;
            for (int64_t e = 0; e < kD; ++e)
              dot +=
                  double(x.q[((t0 + i) * kHq + h) * kD + e]) * x.k[((t0 + j) * kHkv + g) * kD + e];
            const double t = std::tanh(scale * dot / x.softcap);
            ds *= 1.0 - t * t;
          }
          for (int64_t e = 0; e < kD; ++e) {
            dq[((t0 + i) * kHq + h) * kD + e] += scale * ds * x.k[((t0 + j) * kHkv + g) * kD + e];
            dk[((t0 + j) * kHkv + g) * kD + e] += scale * ds * x.q[((t0 + i) * kHq + h) * kD + e];
          }
        }
      }
    }
  }
}

void check(const Problem& x, int threads) {
  const float scale = 0.2f;
  const LengthArrays arrays{x.cu.data(), x.cu.data(), nullptr, nullptr};
  PlanConfig c = x.c;
  c.num_workers = 3;
  const std::vector<Sequence> seqs = resolve_sequences(c, arrays);
  const Plan plan = make_plan(c, seqs);
  const int64_t t = x.cu.back();
  std::vector<float> out(t * kHq * kDv), lse(kHq * std::max<int64_t>(1, t));
  FlashAttnParams f;
  f.config = c;
  f.lengths = arrays;
  f.q = {x.q.data(), 0, kHq * kD, kD, 1};
  f.k = {x.k.data(), 0, kHkv * kD, kD, 1};
  f.v = {x.v.data(), 0, kHkv * kDv, kDv, 1};
  f.sinks = x.sinks.empty() ? nullptr : x.sinks.data();
  f.softmax_scale = scale;
  f.softcap = x.softcap;
  f.alibi_slopes = x.slopes.empty() ? nullptr : x.slopes.data();
  f.out.data = out.data();
  f.out.ss = kHq * kDv;
  f.out.sn = kDv;
  f.out.sd = 1;
  f.lse = lse.data();
  f.lse_sn = t;
  f.lse_ss = 1;
  std::vector<float> ws(std::max<int64_t>(1, workspace_floats(c, plan)));
  const ThreadExecutor ex(threads);
  flash_attn(f, seqs, plan, ex, detected_isa(), ws.data(), nullptr);

  std::vector<float> dq(t * kHq * kD, 0.0f), dk(t * kHkv * kD, 0.0f), dv(t * kHkv * kDv, 0.0f);
  std::vector<float> dsinks(kHq, 0.0f);
  FlashAttnBackwardParams p;
  p.config = c;
  p.q = f.q;
  p.k = f.k;
  p.v = f.v;
  p.out = {out.data(), 0, kHq * kDv, kDv, 1};
  p.dout = {x.dout.data(), 0, kHq * kDv, kDv, 1};
  p.lse = lse.data();
  p.lse_sn = t;
  p.lse_ss = 1;
  p.sinks = f.sinks;
  p.softcap = f.softcap;
  p.alibi_slopes = f.alibi_slopes;
  if (!x.dlse.empty()) {
    p.dlse = x.dlse.data();
    p.dlse_sn = t;
    p.dlse_ss = 1;
  }
  p.softmax_scale = scale;
  p.dq = {dq.data(), 0, kHq * kD, kD, 1};
  p.dk = {dk.data(), 0, kHkv * kD, kD, 1};
  p.dv = {dv.data(), 0, kHkv * kDv, kDv, 1};
  p.dsinks = dsinks.data();
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(isa_name(isa));
    flash_attn_backward(p, seqs, ex, isa);
    std::vector<double> rq, rk, rv, rs;
    reference(x, scale, rq, rk, rv, rs);
    auto near = [](const std::vector<float>& got, const std::vector<double>& want,
                   const char* what) {
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_NEAR(got[i], want[i], 2e-4 * (1 + std::abs(want[i]))) << what << " " << i;
      }
    };
    near(dq, rq, "dq");
    near(dk, rk, "dk");
    near(dv, rv, "dv");
    if (!x.sinks.empty()) near(dsinks, rs, "dsinks");
  }
}

// Sets OPMESH_BACKWARD for a scope: both schedules run on every case.
class BackwardMode {
 public:
  explicit BackwardMode(const char* mode) { setenv("OPMESH_BACKWARD", mode, 1); }
  ~BackwardMode() { unsetenv("OPMESH_BACKWARD"); }
};

TEST(FlashAttnBackward, MatchesDoubleGradientsOnEveryMask) {
  const std::vector<int32_t> lengths{70, 0, 1, 130, 5};
  for (const char* mode : {"fused", "two_pass"}) {
    SCOPED_TRACE(mode);
    const BackwardMode scope(mode);
    check(make(MaskMode::kNone, -1, -1, lengths, false, 1), 1);
    check(make(MaskMode::kCausal, -1, -1, lengths, false, 2), 3);
    check(make(MaskMode::kWindow, 20, 3, lengths, false, 3), 2);
    check(make(MaskMode::kCausal, -1, -1, lengths, true, 4), 4);
    check(make(MaskMode::kWindow, -1, 0, {300}, true, 5), 2);
  }
}

TEST(FlashAttnBackward, GradientOfTheLogSumExpToo) {
  for (bool sinks : {false, true}) {
    Problem x = make(MaskMode::kCausal, -1, -1, {90, 0, 33}, sinks, 11);
    std::mt19937 rng(3);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    x.dlse.resize(kHq * x.cu.back());
    for (auto& e : x.dlse) e = nd(rng);
    check(x, 2);
  }
}

TEST(FlashAttnBackward, SameBitsWhateverTheThreadCountAndPlan) {
  // Run through check() for correctness above; here only the determinism of the result, with
  // the kernel's own plan (workers = 0) and with explicit plans of 1, 3 and 40 workers. The
  // second problem has too few (sequence, key head) pairs for the fused pass, which cuts their
  // keys into chunks.
  for (const Problem& x : {make(MaskMode::kCausal, -1, -1, {150, 0, 77}, true, 9),
                           make(MaskMode::kCausal, -1, -1, {700}, true, 10)}) {
    for (const char* mode : {"fused", "two_pass"}) {
      SCOPED_TRACE(mode);
      const BackwardMode scope(mode);
      std::vector<std::vector<float>> seen;
      for (auto [threads, workers] : {std::pair{1, 0}, {2, 0}, {5, 0}, {2, 1}, {3, 3}, {2, 40}}) {
        const LengthArrays arrays{x.cu.data(), x.cu.data(), nullptr, nullptr};
        PlanConfig c = x.c;
        const std::vector<Sequence> seqs = resolve_sequences(c, arrays);
        const int64_t t = x.cu.back();
        std::vector<float> out(t * kHq * kDv, 0.5f), lse(kHq * t, 3.0f);
        std::vector<float> grads(t * (kHq * kD + kHkv * kD + kHkv * kDv) + kHq, 0.0f);
        FlashAttnBackwardParams p;
        p.config = c;
        p.q = {x.q.data(), 0, kHq * kD, kD, 1};
        p.k = {x.k.data(), 0, kHkv * kD, kD, 1};
        p.v = {x.v.data(), 0, kHkv * kDv, kDv, 1};
        p.out = {out.data(), 0, kHq * kDv, kDv, 1};
        p.dout = {x.dout.data(), 0, kHq * kDv, kDv, 1};
        p.lse = lse.data();
        p.lse_sn = t;
        p.lse_ss = 1;
        p.sinks = x.sinks.data();
        p.softmax_scale = 0.3f;
        float* g = grads.data();
        p.dq = {g, 0, kHq * kD, kD, 1};
        p.dk = {g + t * kHq * kD, 0, kHkv * kD, kD, 1};
        p.dv = {g + t * (kHq * kD + kHkv * kD), 0, kHkv * kDv, kDv, 1};
        p.dsinks = g + t * (kHq * kD + kHkv * kD + kHkv * kDv);
        if (workers == 0) {
          flash_attn_backward(p, seqs, ThreadExecutor(threads), detected_isa());
        } else {
          c.num_workers = workers;
          const BackwardPlan plan = plan_backward(c, seqs);
          // The ranges tile both unit lists in order, one pair per worker.
          ASSERT_EQ(static_cast<int64_t>(plan.cost.size()), workers);
          EXPECT_EQ(plan.key_begin.front(), 0);
          EXPECT_EQ(plan.key_end.back(), plan.num_key_units);
          EXPECT_EQ(plan.query_end.back(), plan.num_query_units);
          for (int64_t w = 1; w < workers; ++w) {
            EXPECT_EQ(plan.key_begin[w], plan.key_end[w - 1]);
            EXPECT_EQ(plan.query_begin[w], plan.query_end[w - 1]);
          }
          EXPECT_GE(plan.makespan, plan.lower_bound * 0.999);
          flash_attn_backward(p, seqs, ThreadExecutor(threads), detected_isa(), &plan);
        }
        seen.push_back(grads);
      }
      for (size_t i = 1; i < seen.size(); ++i) {
        EXPECT_EQ(std::memcmp(seen[0].data(), seen[i].data(), seen[0].size() * 4), 0) << i;
      }
    }
  }
}

// Sets OPMESH_AMX_TILES for a scope.
class AmxTilesEnv {
 public:
  explicit AmxTilesEnv(const char* value) { setenv("OPMESH_AMX_TILES", value, 1); }
  ~AmxTilesEnv() { unsetenv("OPMESH_AMX_TILES"); }
};

std::vector<uint16_t> to_bf16(const std::vector<float>& a) {
  std::vector<uint16_t> out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = float_to_bf16_bits(a[i]);
  return out;
}

// bf16 inputs on the bf16-pair kernels (P and dS rounded to bf16 for the products) against the
// float64 gradients of the same bf16 values: within 1.5 % of each gradient's largest entry (the
// gradients themselves are rounded to bf16, 0.4 %). Every level with pair kernels runs,
// hardware and emulated AMX tiles included.
void check_bf16(Problem x, int threads) {
  for (std::vector<float>* a : {&x.q, &x.k, &x.v, &x.dout}) {
    for (float& e : *a) e = bf16_bits_to_float(float_to_bf16_bits(e));
  }
  const float scale = 0.2f;
  const LengthArrays arrays{x.cu.data(), x.cu.data(), nullptr, nullptr};
  PlanConfig c = x.c;
  c.num_workers = 3;
  const std::vector<Sequence> seqs = resolve_sequences(c, arrays);
  const Plan plan = make_plan(c, seqs);
  const int64_t t = x.cu.back();
  std::vector<float> out(t * kHq * kDv), lse(kHq * std::max<int64_t>(1, t));
  FlashAttnParams f;
  f.config = c;
  f.lengths = arrays;
  f.q = {x.q.data(), 0, kHq * kD, kD, 1};
  f.k = {x.k.data(), 0, kHkv * kD, kD, 1};
  f.v = {x.v.data(), 0, kHkv * kDv, kDv, 1};
  f.sinks = x.sinks.empty() ? nullptr : x.sinks.data();
  f.softmax_scale = scale;
  f.softcap = x.softcap;
  f.alibi_slopes = x.slopes.empty() ? nullptr : x.slopes.data();
  f.out.data = out.data();
  f.out.ss = kHq * kDv;
  f.out.sn = kDv;
  f.out.sd = 1;
  f.lse = lse.data();
  f.lse_sn = t;
  f.lse_ss = 1;
  std::vector<float> ws(std::max<int64_t>(1, workspace_floats(c, plan)));
  const ThreadExecutor ex(threads);
  flash_attn(f, seqs, plan, ex, Isa::kScalar, ws.data(), nullptr);
  std::vector<double> rq, rk, rv, rs;
  reference(x, scale, rq, rk, rv, rs);

  const std::vector<uint16_t> q = to_bf16(x.q), k = to_bf16(x.k), v = to_bf16(x.v);
  const std::vector<uint16_t> o = to_bf16(out), go = to_bf16(x.dout);
  std::vector<uint16_t> dq(t * kHq * kD), dk(t * kHkv * kD), dv(t * kHkv * kDv);
  std::vector<float> dsinks(kHq, 0.0f);
  FlashAttnBackwardParams p;
  p.config = c;
  p.dtype = DType::kBFloat16;
  p.q = {q.data(), 0, kHq * kD, kD, 1};
  p.k = {k.data(), 0, kHkv * kD, kD, 1};
  p.v = {v.data(), 0, kHkv * kDv, kDv, 1};
  p.out = {o.data(), 0, kHq * kDv, kDv, 1};
  p.dout = {go.data(), 0, kHq * kDv, kDv, 1};
  p.lse = lse.data();
  p.lse_sn = t;
  p.lse_ss = 1;
  p.sinks = f.sinks;
  p.softcap = f.softcap;
  p.alibi_slopes = f.alibi_slopes;
  p.softmax_scale = scale;
  p.bf16_pairs = 1;
  p.dq = {dq.data(), 0, kHq * kD, kD, 1};
  p.dk = {dk.data(), 0, kHkv * kD, kD, 1};
  p.dv = {dv.data(), 0, kHkv * kDv, kDv, 1};
  p.dsinks = dsinks.data();
  auto near = [](const std::vector<uint16_t>& got, const std::vector<double>& want,
                 const char* what) {
    double top = 1.0;
    for (double w : want) top = std::max(top, std::abs(w));
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(bf16_bits_to_float(got[i]), want[i], 1.5e-2 * top) << what << " " << i;
    }
  };
  int runs = 0;
  for (const char* tiles : {"auto", "emulate"}) {
    const AmxTilesEnv env(tiles);
    for (Isa isa : supported_isas()) {
      if (static_cast<int>(isa) < static_cast<int>(Isa::kAvx512Bf16)) continue;
      if (std::string(tiles) == "emulate" && isa != Isa::kAmxBf16) continue;
      SCOPED_TRACE(std::string(isa_name(isa)) + " tiles " + tiles);
      std::fill(dq.begin(), dq.end(), 0);
      std::fill(dk.begin(), dk.end(), 0);
      std::fill(dv.begin(), dv.end(), 0);
      flash_attn_backward(p, seqs, ex, isa);
      near(dq, rq, "dq");
      near(dk, rk, "dk");
      near(dv, rv, "dv");
      for (int64_t h = 0; h < kHq && !x.sinks.empty(); ++h) {
        ASSERT_NEAR(dsinks[h], rs[h], 1e-2 * (1 + std::abs(rs[h]))) << "dsinks " << h;
      }
      ++runs;
    }
  }
  if (runs == 0) GTEST_SKIP() << "no bf16-pair kernels on this CPU";
}

TEST(FlashAttnBackward, Bf16PairKernelsMatchDoubleGradients) {
  const std::vector<int32_t> lengths{70, 0, 1, 130, 5};
  for (const char* mode : {"fused", "two_pass"}) {
    SCOPED_TRACE(mode);
    const BackwardMode scope(mode);
    check_bf16(make(MaskMode::kNone, -1, -1, lengths, false, 1), 1);
    check_bf16(make(MaskMode::kCausal, -1, -1, lengths, true, 4), 3);
    check_bf16(make(MaskMode::kWindow, 20, 3, lengths, false, 3), 2);
    check_bf16(make(MaskMode::kWindow, -1, 0, {300}, true, 5), 2);
  }
}

// Fewer (sequence, key head) pairs than the fused pass wants units: it cuts each pair's keys
// into chunks of whole key blocks, each with its own dQ part over the query tiles that see it,
// summed in chunk order. Sequences of different block counts (a chunk without blocks is left
// out), a window that leaves each chunk's keys to a few query tiles, float32 and bf16 pairs.
TEST(FlashAttnBackward, FusedChunksMatchDoubleGradients) {
  struct Case {
    Problem x;
    int64_t units;  // fused units of the plan: chunks that hold key blocks, per key head
  };
  const std::vector<Case> cases = {
      // 1 sequence x 2 key heads, 3 blocks: 3 chunks of one block.
      {make(MaskMode::kCausal, -1, -1, {700}, false, 21), 2 * 3},
      // 4 pairs: 2 chunks each, blocks [0, 1) and [1, 3) of 600 keys, [0, 1) and [1, 2) of 300.
      {make(MaskMode::kWindow, 90, 0, {600, 0, 300}, true, 22), 2 * 2 + 2 * 2},
      // 4 pairs: 520 keys in 2 chunks; 1 key in one (its first chunk has no block).
      {make(MaskMode::kNone, -1, -1, {520, 1}, false, 23), 2 * 2 + 2 * 1},
  };
  for (const char* mode : {"auto", "fused"}) {
    SCOPED_TRACE(mode);
    const BackwardMode scope(mode);
    for (const Case& k : cases) {
      PlanConfig c = k.x.c;
      c.num_workers = 2;
      const LengthArrays arrays{k.x.cu.data(), k.x.cu.data(), nullptr, nullptr};
      const BackwardPlan plan = plan_backward(c, resolve_sequences(c, arrays));
      EXPECT_TRUE(plan.fused);
      EXPECT_EQ(plan.num_key_units, k.units);
      check(k.x, 2);
      check_bf16(k.x, 3);
    }
  }
}

// Long sequences, planned only (no data): the schedule auto takes where the accumulators are large.
// One causal 16384-token sequence, D = 128, 4 query heads per key head, BSND: a whole pair's dQ
// accumulator is 32 MiB.
TEST(FlashAttnBackward, LongSequencesKeepTheFusedSchedule) {
  const BackwardMode scope("auto");
  auto plan_of = [](int64_t seq, int64_t heads_kv) {
    PlanConfig c;
    c.num_heads_q = 4 * heads_kv;
    c.num_heads_kv = heads_kv;
    c.head_dim = c.head_dim_v = 128;
    c.batch_size = 1;
    c.max_seqlen_q = c.max_seqlen_kv = seq;
    c.mask_mode = MaskMode::kCausal;
    c.num_workers = 2;
    return plan_backward(c, resolve_sequences(c, LengthArrays{}));
  };
  // 8 pairs: whole pairs, 32 MiB each (within 64 MiB).
  BackwardPlan p = plan_of(16384, 8);
  EXPECT_TRUE(p.fused);
  EXPECT_EQ(p.num_key_units, 8);
  // 2 pairs (Ulysses' share of 32/8 heads on 4 ranks): 4 chunks each would hold 2 x 80 MiB of
  // parts (the chunks cover 256, 192, 128 and 64 query tiles), 3 would hold 2 x 64.5 MiB; 2 hold
  // 2 x 48 MiB, within 128 MiB.
  p = plan_of(16384, 2);
  EXPECT_TRUE(p.fused);
  EXPECT_EQ(p.num_key_units, 2 * 2);
  // 8 pairs of 32768 tokens: a 64 MiB accumulator each, still fused.
  p = plan_of(32768, 8);
  EXPECT_TRUE(p.fused);
  EXPECT_EQ(p.num_key_units, 8);
  // 8 pairs of 65536 tokens (128 MiB each): the two passes.
  EXPECT_FALSE(plan_of(65536, 8).fused);
  // 1 pair of 65536 tokens: even 2 chunks' parts (over 1024 and 512 query tiles, 192 MiB) pass
  // 128 MiB: the two passes.
  EXPECT_FALSE(plan_of(65536, 1).fused);
}

// softcap (the scores' derivative through tanh) and ALiBi, alone and together, on both schedules
// and every level; bf16 on the pair kernels too.
TEST(FlashAttnBackward, SoftcapAndAlibi) {
  const std::vector<int32_t> lengths{70, 0, 1, 130, 5};
  for (const char* mode : {"fused", "two_pass"}) {
    SCOPED_TRACE(mode);
    const BackwardMode scope(mode);
    for (int variant = 0; variant < 3; ++variant) {
      SCOPED_TRACE(variant);
      const bool window = variant == 2;
      Problem x = make(window ? MaskMode::kWindow : MaskMode::kCausal, window ? 20 : -1,
                       window ? 3 : -1, lengths, variant == 1, 20 + variant);
      if (variant != 1) x.softcap = 1.5f;
      if (variant != 0) x.slopes = {0.5f, 0.25f, 0.125f, 0.0625f};
      check(x, 2);
      check_bf16(x, 3);
    }
  }
}

TEST(FlashAttnBackward, RefusesPagedCachesAndMissingPointers) {
  const Problem x = make(MaskMode::kCausal, -1, -1, {3}, true, 1);
  const LengthArrays arrays{x.cu.data(), x.cu.data(), nullptr, nullptr};
  const std::vector<Sequence> seqs = resolve_sequences(x.c, arrays);
  FlashAttnBackwardParams p;
  p.config = x.c;
  auto expect = [&](const FlashAttnBackwardParams& bad, const std::string& arg) {
    try {
      validate_backward(bad, seqs, Isa::kScalar);
      FAIL() << "expected an error naming " << arg;
    } catch (const ArgumentError& e) {
      EXPECT_EQ(std::string(e.what()).rfind(arg + ":", 0), 0u) << e.what();
    }
  };
  expect(p, "q");
  FlashAttnBackwardParams paged = p;
  paged.config.layout_kv = Layout::kPagedBBND;
  expect(paged, "layout_kv");
}

}  // namespace
}  // namespace opmesh::core::attention
