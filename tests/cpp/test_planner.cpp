// The attention planner and metadata format: tile spans against a brute-force mask, exact
// coverage, balance against the lower bound, deterministic split points, the metadata round trip
// and its refusal of calls that differ.
#include <gtest/gtest.h>

#include <random>
#include <stdexcept>
#include <vector>

#include "attention/config.h"
#include "attention/metadata.h"
#include "attention/planner.h"
#include "errors.h"

namespace opmesh::core::attention {
namespace {

PlanConfig tnd_config(int64_t batch, int64_t max_len, int64_t workers, MaskMode mode) {
  PlanConfig c;
  c.num_heads_q = 8;
  c.num_heads_kv = 2;
  c.head_dim = c.head_dim_v = 128;
  c.batch_size = batch;
  c.max_seqlen_q = c.max_seqlen_kv = max_len;
  c.mask_mode = mode;
  c.layout_q = c.layout_kv = c.layout_out = Layout::kTND;
  c.num_workers = workers;
  return c;
}

std::vector<int32_t> cumulative(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu{0};
  for (int32_t n : lens) cu.push_back(cu.back() + n);
  return cu;
}

TEST(TileSpan, MatchesBruteForceMaskForEveryMode) {
  struct Mode {
    MaskMode mode;
    int64_t left, right;
  };
  const Mode modes[] = {{MaskMode::kNone, -1, -1},   {MaskMode::kCausal, -1, -1},
                        {MaskMode::kWindow, 0, 0},   {MaskMode::kWindow, 1, 1},
                        {MaskMode::kWindow, 70, -1}, {MaskMode::kWindow, -1, 3},
                        {MaskMode::kWindow, 5, 200}};
  for (const Mode& m : modes) {
    PlanConfig c = tnd_config(1, 1000, 1, m.mode);
    c.win_left = m.left;
    c.win_right = m.right;
    for (auto [q_len, k_len] : {std::pair{7, 300}, {300, 7}, {130, 130}, {1, 0}, {64, 1}}) {
      const Sequence s{0, q_len, 0, k_len};
      for (int64_t p0 = 0; p0 < q_len; p0 += 16) {
        const int64_t p1 = std::min<int64_t>(q_len, p0 + 16);
        const TileSpan t = tile_span(c, s, p0, p1);
        for (int64_t tile = 0; tile * kKeyTile < std::max<int64_t>(k_len, 1); ++tile) {
          bool any = false, all = true;
          for (int64_t i = p0; i < p1; ++i) {
            for (int64_t j = tile * kKeyTile; j < (tile + 1) * kKeyTile; ++j) {
              const KeyRange r = visible_keys(c, s, i);
              const bool visible = j < k_len && j >= r.begin && j < r.end;
              // The brute-force definition, independent of visible_keys.
              const int64_t diag = i + k_len - q_len;
              bool want = j < k_len;
              if (m.mode == MaskMode::kCausal) want = want && j <= diag;
              if (m.mode == MaskMode::kWindow) {
                want = want && (m.left < 0 || j >= diag - m.left) &&
                       (m.right < 0 || j <= diag + m.right);
              }
              ASSERT_EQ(visible, want) << i << " " << j;
              any = any || want;
              all = all && want;
            }
          }
          const bool in_span = tile >= t.begin && tile < t.end;
          const bool in_full = tile >= t.full_begin && tile < t.full_end;
          EXPECT_EQ(in_span, any) << "tile " << tile << " rows " << p0 << ".." << p1;
          if (in_full) EXPECT_TRUE(all) << "tile " << tile;
          if (all && any) EXPECT_TRUE(in_full || !in_span) << "full tile marked masked " << tile;
        }
      }
    }
  }
}

TEST(Planner, CoversExactlyOnceAndStaysNearTheLowerBound) {
  std::mt19937 rng(5);
  std::lognormal_distribution<double> length(6.5, 1.0);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<int32_t> lens;
    for (int b = 0; b < 32; ++b) lens.push_back(std::min(16384, static_cast<int>(length(rng))));
    lens[trial % 32] = 0;  // an empty sequence
    const std::vector<int32_t> cu = cumulative(lens);
    for (int64_t workers : {1, 2, 7, 24, 132}) {
      for (bool det : {false, true}) {
        PlanConfig c = tnd_config(32, 16384, workers, MaskMode::kCausal);
        c.deterministic = det;
        const auto seqs = resolve_sequences(c, {cu.data(), cu.data(), nullptr, nullptr});
        const Plan plan = make_plan(c, seqs);  // runs verify_coverage itself
        EXPECT_NO_THROW(verify_coverage(c, seqs, plan));
        EXPECT_GE(plan.makespan, plan.lower_bound * (1 - 1e-6));
        if (!det) EXPECT_LE(plan.makespan, 1.05 * plan.lower_bound) << workers;
        if (det) {
          for (const WorkerRange& r : plan.workers) {
            // Deterministic cuts fall on fixed key positions (or unit starts).
            const UnitWalker walker(c, seqs);
            if (walker.mid_unit(r.end)) EXPECT_EQ(r.end.k % kDeterministicChunkTiles, 0);
          }
        }
      }
    }
  }
}

TEST(Planner, VerifyCoverageRejectsBrokenPlans) {
  const std::vector<int32_t> lens{500, 900, 3};
  const std::vector<int32_t> cu = cumulative(lens);
  const PlanConfig c = tnd_config(3, 1000, 5, MaskMode::kCausal);
  const auto seqs = resolve_sequences(c, {cu.data(), cu.data(), nullptr, nullptr});
  const Plan good = make_plan(c, seqs);
  ASSERT_GT(good.combines.size(), 0u);
  Plan gap = good;
  gap.workers[1].begin.t += 1;  // skips a unit
  EXPECT_THROW(verify_coverage(c, seqs, gap), std::logic_error);
  Plan overlap = good;
  overlap.workers[2].begin = overlap.workers[1].begin;  // repeats work
  EXPECT_THROW(verify_coverage(c, seqs, overlap), std::logic_error);
  Plan short_plan = good;
  short_plan.workers.back().end = short_plan.workers.back().begin;  // leaves work undone
  EXPECT_THROW(verify_coverage(c, seqs, short_plan), std::logic_error);
  Plan slots = good;
  slots.combines[0].num_slots += 1;
  EXPECT_THROW(verify_coverage(c, seqs, slots), std::logic_error);
}

TEST(Planner, LongDecodeRowIsSplitEvenly) {
  PlanConfig c = tnd_config(1, 1 << 17, 16, MaskMode::kNone);
  c.layout_q = c.layout_kv = c.layout_out = Layout::kBSND;
  c.max_seqlen_q = 1;
  const auto seqs = resolve_sequences(c, {});
  const Plan plan = make_plan(c, seqs);
  // Two key heads, one query tile each: each unit spread over 8 workers.
  ASSERT_EQ(plan.combines.size(), 2u);
  EXPECT_EQ(plan.combines[0].num_slots, 8);
  EXPECT_EQ(plan.combines[1].num_slots, 8);
  EXPECT_LE(plan.makespan, 1.02 * plan.lower_bound);
}

TEST(Metadata, RoundTripsAndRefusesOtherCalls) {
  const std::vector<int32_t> lens{17, 0, 400};
  const std::vector<int32_t> cu = cumulative(lens);
  const LengthArrays arrays{cu.data(), cu.data(), nullptr, nullptr};
  const PlanConfig c = tnd_config(3, 400, 7, MaskMode::kCausal);
  std::vector<int32_t> words(metadata::size_words(7));
  metadata::write(c, arrays, words.data());
  const metadata::Decoded d = metadata::read(words.data(), static_cast<int64_t>(words.size()));
  EXPECT_EQ(d.config.num_workers, 7);
  EXPECT_EQ(d.plan.workers.size(), 7u);
  EXPECT_NO_THROW(metadata::verify(d, c, arrays));
  PlanConfig other = c;
  other.head_dim_v = 64;
  try {
    metadata::verify(d, other, arrays);
    FAIL() << "a different head_dim_v was accepted";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim_v=128"), std::string::npos) << e.what();
  }
  std::vector<int32_t> moved = cu;
  moved[1] += 1;
  moved[2] += 1;
  EXPECT_THROW(metadata::verify(d, c, {moved.data(), cu.data(), nullptr, nullptr}), ArgumentError);
  const int32_t used[3] = {17, 0, 400};
  EXPECT_THROW(metadata::verify(d, c, {cu.data(), cu.data(), used, nullptr}), ArgumentError);
  words[plan_words::kVersionWord] = 99;
  EXPECT_THROW(metadata::read(words.data(), static_cast<int64_t>(words.size())), ArgumentError);
  EXPECT_THROW(metadata::read(words.data(), 10), ArgumentError);
}

}  // namespace
}  // namespace opmesh::core::attention
