#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "executor.h"
#include "indexer/tiling.h"
#include "thread_executor.h"
#include "work_split.h"

namespace opmesh::core::indexer {
namespace {

// visible_key_end for query row i of a sequence of q_len queries and k_len keys.
int64_t end_of(MaskMode mode, int64_t i, int64_t q_len, int64_t k_len) {
  return visible_key_end(mode, Sequence{0, q_len, 0, k_len}, i);
}

TEST(Tiling, VisibleKeyEndCausalBottomRight) {
  // s1 == s2: plain causal.
  EXPECT_EQ(end_of(MaskMode::kCausal, 0, 5, 5), 1);
  EXPECT_EQ(end_of(MaskMode::kCausal, 4, 5, 5), 5);
  // s2 > s1: the last query sees every key.
  EXPECT_EQ(end_of(MaskMode::kCausal, 0, 2, 7), 6);
  EXPECT_EQ(end_of(MaskMode::kCausal, 1, 2, 7), 7);
  // s1 > s2: the first s1 - s2 rows see nothing.
  EXPECT_EQ(end_of(MaskMode::kCausal, 0, 7, 2), 0);
  EXPECT_EQ(end_of(MaskMode::kCausal, 4, 7, 2), 0);
  EXPECT_EQ(end_of(MaskMode::kCausal, 5, 7, 2), 1);
  EXPECT_EQ(end_of(MaskMode::kCausal, 6, 7, 2), 2);
  // Empty key sequence.
  EXPECT_EQ(end_of(MaskMode::kCausal, 0, 1, 0), 0);
  EXPECT_EQ(end_of(MaskMode::kNone, 3, 7, 0), 0);
  EXPECT_EQ(end_of(MaskMode::kNone, 0, 7, 2), 2);
}

TEST(Tiling, MasksWithAnExplicitDiagonal) {
  // A slice of queries 4..7 of an 8 x 8 causal sequence, against all 8 keys: row 0 of the slice
  // is query 4, whose diagonal key is 4.
  Sequence slice{0, 4, 0, 8};
  slice.diagonal = 4;
  const Mask causal{MaskMode::kCausal, -1, -1};
  EXPECT_EQ(visible_keys(causal, slice, 0).end, 5);
  EXPECT_EQ(visible_keys(causal, slice, 3).end, 8);
  // The default is bottom-right: the same slice without the offset sees keys up to 4 + i + 1.
  EXPECT_EQ(visible_keys(causal, Sequence{0, 4, 0, 8}, 0).end, 5);
  const Mask window{MaskMode::kWindow, 2, 1};
  const KeyRange r = visible_keys(window, slice, 1);  // query 5: keys 3..6
  EXPECT_EQ(r.begin, 3);
  EXPECT_EQ(r.end, 7);
  slice.diagonal = -10;  // every row before its first key: nothing visible
  EXPECT_EQ(visible_keys(causal, slice, 3).end, 0);
  EXPECT_EQ(visible_keys(Mask{}, slice, 3).end, 8);
}

// Weighted key blocks: contiguous, covering every key, at most `parts` per (sequence, head), at
// least min_block keys (but the last), and cut at equal shares of the weights.
TEST(WorkSplit, WeightedKeyTasksShareTheWeights) {
  std::vector<Sequence> seqs(2);
  seqs[0].k_len = 1000;
  seqs[1].k_len = 37;
  seqs[1].batch = 1;
  auto weights = [](const Sequence& s, int64_t g) {
    std::vector<int64_t> w(s.k_len);
    for (int64_t j = 0; j < s.k_len; ++j) w[j] = j < s.k_len / 4 ? 10 + g : 1;  // early keys heavy
    return w;
  };
  for (const int64_t parts : {1, 2, 4, 7}) {
    SCOPED_TRACE(parts);
    const std::vector<KeyTask> tasks = weighted_key_tasks(seqs, 2, parts, 16, weights);
    for (const Sequence& s : seqs) {
      for (int64_t g = 0; g < 2; ++g) {
        const std::vector<int64_t> w = weights(s, g);
        int64_t total = 0;
        for (int64_t x : w) total += x;
        int64_t next = 0, blocks = 0, before = 0;
        for (const KeyTask& t : tasks) {
          if (t.b != s.batch || t.g != g) continue;
          EXPECT_EQ(t.j0, next);
          EXPECT_GT(t.j1, t.j0);
          if (t.j1 != s.k_len) {
            EXPECT_GE(t.j1 - t.j0, 16);
            // Cut at the first key where the weight reaches the next share (or min_block later).
            int64_t sum = before;
            for (int64_t j = t.j0; j < t.j1; ++j) sum += w[j];
            EXPECT_GE(sum * parts, (blocks + 1) * total);
            if (t.j1 - t.j0 > 16) EXPECT_LT((sum - w[t.j1 - 1]) * parts, (blocks + 1) * total);
          }
          for (int64_t j = t.j0; j < t.j1; ++j) before += w[j];
          next = t.j1;
          ++blocks;
        }
        EXPECT_EQ(next, s.k_len);
        EXPECT_LE(blocks, parts);
        if (s.k_len >= 16 * parts) EXPECT_EQ(blocks, parts);
      }
    }
  }
}

TEST(RunDynamic, EveryTaskOnceAndALoneTaskWithoutAParallelRegion) {
  for (int64_t tasks : {0, 1, 2, 7}) {
    CountingExecutor ex;
    std::vector<std::atomic<int>> runs(static_cast<size_t>(tasks));
    std::atomic<int> bad_worker{0};
    run_dynamic(ex, tasks, [&](int64_t t, int worker) {
      ++runs[static_cast<size_t>(t)];
      if (worker < 0 || worker >= ex.num_workers()) ++bad_worker;
    });
    for (const auto& r : runs) EXPECT_EQ(r.load(), 1) << tasks << " tasks";
    EXPECT_EQ(bad_worker.load(), 0);
    // No task: nothing to run; one: on the calling thread, as worker 0; more: one region.
    EXPECT_EQ(ex.regions, tasks >= 2 ? 1 : 0) << tasks << " tasks";
  }
}

}  // namespace
}  // namespace opmesh::core::indexer
