#include <gtest/gtest.h>

#include <vector>

#include "indexer_tiling.h"

namespace opmesh::core::indexer {
namespace {

TEST(Tiling, VisibleKeyEndCausalBottomRight) {
  // s1 == s2: plain causal.
  EXPECT_EQ(visible_key_end(SparseMode::kCausal, 0, 5, 5), 1);
  EXPECT_EQ(visible_key_end(SparseMode::kCausal, 4, 5, 5), 5);
  // s2 > s1: the last query sees every key.
  EXPECT_EQ(visible_key_end(SparseMode::kCausal, 0, 2, 7), 6);
  EXPECT_EQ(visible_key_end(SparseMode::kCausal, 1, 2, 7), 7);
  // s1 > s2: the first s1 - s2 rows see nothing.
  EXPECT_EQ(visible_key_end(SparseMode::kCausal, 0, 7, 2), 0);
  EXPECT_EQ(visible_key_end(SparseMode::kCausal, 4, 7, 2), 0);
  EXPECT_EQ(visible_key_end(SparseMode::kCausal, 5, 7, 2), 1);
  EXPECT_EQ(visible_key_end(SparseMode::kCausal, 6, 7, 2), 2);
  // Empty key sequence.
  EXPECT_EQ(visible_key_end(SparseMode::kCausal, 0, 1, 0), 0);
  EXPECT_EQ(visible_key_end(SparseMode::kNone, 3, 7, 0), 0);
  EXPECT_EQ(visible_key_end(SparseMode::kNone, 0, 7, 2), 2);
}

TEST(Tiling, TasksCoverEveryRowOnceAndComeMostExpensiveFirst) {
  const std::vector<Sequence> seqs = {
      {0, 0, 0, 100, 100}, {1, 100, 100, 0, 5}, {2, 100, 105, 33, 1000}, {3, 133, 1105, 1, 0}};
  for (SparseMode mode : {SparseMode::kNone, SparseMode::kCausal}) {
    const std::vector<Task> tasks = make_tasks(seqs, mode, kQueryTile);
    std::vector<std::vector<int>> covered(seqs.size());
    for (size_t s = 0; s < seqs.size(); ++s) covered[s].assign(seqs[s].q_len, 0);
    for (size_t t = 0; t < tasks.size(); ++t) {
      const Task& task = tasks[t];
      EXPECT_LT(task.row_begin, task.row_end);
      EXPECT_LE(task.row_end - task.row_begin, kQueryTile);
      for (int64_t r = task.row_begin; r < task.row_end; ++r) ++covered[task.sequence][r];
      if (t > 0) EXPECT_GE(tasks[t - 1].cost, task.cost);
    }
    for (size_t s = 0; s < seqs.size(); ++s) {
      for (int c : covered[s]) EXPECT_EQ(c, 1) << "sequence " << s;
    }
  }
}

}  // namespace
}  // namespace opmesh::core::indexer
