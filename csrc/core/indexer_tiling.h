// Tiling and masking arithmetic of the indexer kernel, kept apart so it can be tested alone.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "indexer.h"
#include "kernels/kernel_set.h"
#include "vocabulary.h"

namespace opmesh::core::indexer {

using kernels::kKeyTile;
inline constexpr int kQueryTile = 32;  // query positions per task

// Exclusive end of the keys visible to query row i (0-based within its sequence); 0 = none. The
// indexer's masks (none, causal) always start at key 0.
inline int64_t visible_key_end(MaskMode mode, const Sequence& seq, int64_t i) {
  return visible_keys(Mask{mode, -1, -1}, seq, i).end;
}

// A unit of parallel work: query rows [row_begin, row_end) of one sequence.
struct Task {
  int64_t sequence = 0;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  int64_t cost = 0;  // visible (row, key) pairs, rounded up to whole key tiles
};

// Cuts every sequence into query tiles. Tasks are returned most expensive first so that workers
// pulling from a shared counter finish at about the same time.
inline std::vector<Task> make_tasks(const std::vector<Sequence>& sequences, MaskMode mode,
                                    int64_t query_tile) {
  std::vector<Task> tasks;
  for (int64_t s = 0; s < static_cast<int64_t>(sequences.size()); ++s) {
    const Sequence& seq = sequences[s];
    for (int64_t r0 = 0; r0 < seq.q_len; r0 += query_tile) {
      const int64_t r1 = std::min(seq.q_len, r0 + query_tile);
      const int64_t key_end = visible_key_end(mode, seq, r1 - 1);
      const int64_t tiles = (key_end + kKeyTile - 1) / kKeyTile;
      tasks.push_back({s, r0, r1, (r1 - r0) * (tiles * kKeyTile + kKeyTile)});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return tasks;
}

}  // namespace opmesh::core::indexer
