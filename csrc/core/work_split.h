// How the sequence operators cut their work into tasks for run_dynamic, and the per-worker
// scratch they keep while running them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "vocabulary.h"

namespace opmesh::core {

// Query tokens [i0, i1) of sequence b.
struct TokenTask {
  int32_t b;
  int64_t i0, i1;
};

// Keys [j0, j1) of sequence b for key head g.
struct KeyTask {
  int32_t b;
  int64_t g, j0, j1;
};

// Every sequence's tokens in runs of `per_task`.
inline std::vector<TokenTask> token_tasks(const std::vector<Sequence>& seqs, int64_t per_task) {
  std::vector<TokenTask> tasks;
  for (const Sequence& s : seqs) {
    for (int64_t i = 0; i < s.q_len; i += per_task) {
      tasks.push_back({static_cast<int32_t>(s.batch), i, std::min(s.q_len, i + per_task)});
    }
  }
  return tasks;
}

// Every sequence's keys for each of `heads` key heads, in about `parts` blocks of at least
// `min_block` keys.
inline std::vector<KeyTask> key_tasks(const std::vector<Sequence>& seqs, int64_t heads,
                                      int64_t parts, int64_t min_block) {
  std::vector<KeyTask> tasks;
  for (const Sequence& s : seqs) {
    const int64_t block = std::max<int64_t>(min_block, (s.k_len + parts - 1) / parts);
    for (int64_t g = 0; g < heads; ++g) {
      for (int64_t j = 0; j < s.k_len; j += block) {
        tasks.push_back({static_cast<int32_t>(s.batch), g, j, std::min(s.k_len, j + block)});
      }
    }
  }
  return tasks;
}

// Like key_tasks, but each (sequence, head)'s keys are cut into at most `parts` blocks of about
// equal weight: weights(s, g) gives one non-negative weight per key of s (the work it brings),
// and a block holds at least `min_block` keys (the last one the rest).
template <class Weights>
std::vector<KeyTask> weighted_key_tasks(const std::vector<Sequence>& seqs, int64_t heads,
                                        int64_t parts, int64_t min_block, Weights weights) {
  std::vector<KeyTask> tasks;
  for (const Sequence& s : seqs) {
    for (int64_t g = 0; g < heads; ++g) {
      const std::vector<int64_t> w = weights(s, g);
      int64_t total = 0;
      for (int64_t x : w) total += x;
      int64_t j0 = 0, sum = 0, cuts = 0;
      for (int64_t j = 0; j < s.k_len; ++j) {
        sum += w[j];
        const bool share = cuts + 1 < parts && (cuts + 1) * total <= sum * parts;
        if (j + 1 == s.k_len || (share && j + 1 - j0 >= min_block)) {
          tasks.push_back({static_cast<int32_t>(s.batch), g, j0, j + 1});
          j0 = j + 1;
          ++cuts;
        }
      }
    }
  }
  return tasks;
}

// One Scratch per worker, made from the run on the worker's first task.
template <class Scratch, class Run>
class ScratchPool {
 public:
  ScratchPool(Run& run, int workers) : run_(run), scratch_(static_cast<size_t>(workers)) {}

  Scratch& operator[](int worker) {
    if (!scratch_[worker]) scratch_[worker] = std::make_unique<Scratch>(run_);
    return *scratch_[worker];
  }

 private:
  Run& run_;
  std::vector<std::unique_ptr<Scratch>> scratch_;
};

}  // namespace opmesh::core
