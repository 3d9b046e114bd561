// The work planner: cuts the attention work of a batch into tasks and spreads them over logical
// workers (see docs/ops/flash_attn.md, "How the work is planned").
//
// Work is enumerated in a canonical order: sequence b, then key head h, then query tile t, then
// key tile k. A *unit* is one (b, h, t): a query tile and the key tiles it sees. Each worker gets
// one contiguous stretch of that order, from a begin position to an end position, so a unit is
// split along the key axis at most where a stretch ends. The pieces of a split unit write partial
// results (unnormalised output, row max, row sum) to workspace slots, and a combine task merges
// them by their log-sum-exp once every worker is done.
#pragma once

#include <cstdint>
#include <vector>

#include "config.h"
#include "cost_model.h"

namespace opmesh::core::attention {

// A point in the canonical order: unit (b, h, t) and absolute key tile k within the unit's span.
// The end of the work is {batch_size, 0, 0, 0}.
struct Position {
  int32_t b = 0;
  int32_t h = 0;
  int32_t t = 0;
  int32_t k = 0;
  // Spelled out: the core's headers compile as C++17 too (the MindSpore binding's standard).
  bool operator==(const Position& o) const { return b == o.b && h == o.h && t == o.t && k == o.k; }
  bool operator!=(const Position& o) const { return !(*this == o); }
};

struct WorkerRange {
  Position begin;
  Position end;        // exclusive
  int32_t begin_slot;  // first slot of the first piece when it continues a split unit, else -1
  int32_t end_slot;    // slot of the last piece when it starts a unit it does not finish, else -1
  float cost;          // predicted ns
};

struct CombineTask {
  int32_t b, h, t;
  int32_t first_slot;
  int32_t num_slots;  // partial results to merge, in slot order
};

struct Plan {
  Geometry geometry;
  int64_t chunk_tiles = 0;  // deterministic mode: key tiles per fixed split; 0 otherwise
  std::vector<WorkerRange> workers;
  std::vector<CombineTask> combines;
  int64_t num_slots = 0;
  int64_t num_tasks = 0;   // pieces over all workers, plus combine tasks
  double makespan = 0;     // max worker cost
  double lower_bound = 0;  // max(total / workers, largest indivisible task)
  double total_cost = 0;   // sum of unit costs without splitting
};

// Key tiles per split in deterministic mode (1024 keys).
inline constexpr int64_t kDeterministicChunkTiles = 16;

// Plans the call. `sequences` come from resolve_sequences(config, ...).
Plan make_plan(const PlanConfig& config, const std::vector<Sequence>& sequences,
               const CostModel& model = default_cost_model());

// Checks that the workers' stretches tile the canonical order exactly once: every position is a
// valid cut point, each stretch starts where the previous one ended, the first starts at the
// first unit and the last ends at the end, and the slots and combine tasks of split units agree
// with the stretches. O(num_workers). Throws std::logic_error otherwise.
void verify_coverage(const PlanConfig& config, const std::vector<Sequence>& sequences,
                     const Plan& plan);

class UnitWalker;
void verify_coverage(const PlanConfig& config, const UnitWalker& walker, const Plan& plan);

// Navigates the canonical order; tile spans are computed once per (sequence, query tile).
class UnitWalker {
 public:
  UnitWalker(const PlanConfig& config, const std::vector<Sequence>& sequences);
  int64_t num_query_tiles(int64_t b) const { return tiles_[b + 1] - tiles_[b]; }
  const TileSpan& span(int64_t b, int64_t t) const { return spans_[tiles_[b] + t]; }
  // Query positions [p0, p1) of tile t of sequence b.
  int64_t tile_begin(int64_t t) const { return t * geometry_.positions; }
  int64_t tile_end(int64_t b, int64_t t) const;
  // The canonical successor of unit (b, h, t), skipping sequences with no query tile;
  // returns the end position when there is none.
  Position next_unit(Position p) const;
  Position first_unit() const { return skip_empty({0, 0, 0, 0}); }
  Position end() const { return {static_cast<int32_t>(batch_), 0, 0, 0}; }
  Position unit_start(int32_t b, int32_t h, int32_t t) const;
  bool is_end(const Position& p) const { return p.b >= batch_; }
  // Whether p is a cut point: the end, or a unit with k in [span.begin, span.end) (k ==
  // span.begin for a unit without key tiles).
  bool valid(const Position& p) const;
  // Whether p lies inside a unit's key tiles rather than at its start.
  bool mid_unit(const Position& p) const { return !is_end(p) && p.k > span(p.b, p.t).begin; }
  // Index of p's unit in the canonical order (the unit count for the end).
  int64_t unit_index(const Position& p) const;

  template <class Fn>
  void for_each_piece(const Position& begin, const Position& end, Fn&& fn) const {
    Position p = begin;
    while (!is_end(p) && !(p == end)) {
      const TileSpan& s = span(p.b, p.t);
      const bool last = p.b == end.b && p.h == end.h && p.t == end.t;
      const int32_t k_to = last ? end.k : static_cast<int32_t>(s.end);
      if (last && k_to == p.k) break;
      fn(p.b, p.h, p.t, p.k, k_to, s);
      if (last) break;
      p = next_unit(p);
    }
  }

 private:
  Position skip_empty(Position p) const;
  int64_t batch_;
  int64_t heads_;
  Geometry geometry_;
  std::vector<int64_t> q_len_;
  std::vector<int64_t> tiles_;  // exclusive prefix of query tiles per sequence (batch + 1)
  std::vector<TileSpan> spans_;
};

}  // namespace opmesh::core::attention
