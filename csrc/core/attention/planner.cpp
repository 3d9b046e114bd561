#include "planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>

namespace opmesh::core::attention {

// ---------------------------------------------------------------------------------------------
// UnitWalker

UnitWalker::UnitWalker(const PlanConfig& config, const std::vector<Sequence>& sequences)
    : batch_(config.batch_size), heads_(config.num_heads_kv), geometry_(geometry(config)) {
  q_len_.resize(batch_);
  tiles_.assign(batch_ + 1, 0);
  for (int64_t b = 0; b < batch_; ++b) {
    q_len_[b] = sequences[b].q_len;
    tiles_[b + 1] = tiles_[b] + (q_len_[b] + geometry_.positions - 1) / geometry_.positions;
  }
  spans_.resize(tiles_[batch_]);
  for (int64_t b = 0; b < batch_; ++b) {
    for (int64_t t = 0; t < num_query_tiles(b); ++t) {
      spans_[tiles_[b] + t] = tile_span(config, sequences[b], tile_begin(t), tile_end(b, t));
    }
  }
}

int64_t UnitWalker::tile_end(int64_t b, int64_t t) const {
  return std::min(q_len_[b], (t + 1) * geometry_.positions);
}

Position UnitWalker::skip_empty(Position p) const {
  while (p.b < batch_ && num_query_tiles(p.b) == 0) {
    ++p.b;
    p.h = p.t = 0;
  }
  if (p.b >= batch_) return end();
  p.k = static_cast<int32_t>(span(p.b, p.t).begin);
  return p;
}

Position UnitWalker::unit_start(int32_t b, int32_t h, int32_t t) const {
  return {b, h, t, static_cast<int32_t>(span(b, t).begin)};
}

Position UnitWalker::next_unit(Position p) const {
  if (p.t + 1 < num_query_tiles(p.b)) return unit_start(p.b, p.h, p.t + 1);
  if (p.h + 1 < heads_) return unit_start(p.b, p.h + 1, 0);
  return skip_empty({p.b + 1, 0, 0, 0});
}

bool UnitWalker::valid(const Position& p) const {
  if (p == end()) return true;
  if (p.b < 0 || p.b >= batch_ || p.h < 0 || p.h >= heads_ || p.t < 0 ||
      p.t >= num_query_tiles(p.b)) {
    return false;
  }
  const TileSpan& s = span(p.b, p.t);
  return p.k == s.begin || (p.k > s.begin && p.k < s.end);
}

int64_t UnitWalker::unit_index(const Position& p) const {
  if (is_end(p)) return tiles_[batch_] * heads_;
  return tiles_[p.b] * heads_ + p.h * num_query_tiles(p.b) + p.t;
}

// ---------------------------------------------------------------------------------------------
// Planner

namespace {

// Relative precision of the capacity search: far below the cost model's own accuracy.
constexpr double kCapacityTolerance = 5e-5;

bool before(const Position& a, const Position& b) {
  return std::tie(a.b, a.h, a.t, a.k) < std::tie(b.b, b.h, b.t, b.k);
}

class Planner {
 public:
  Planner(const PlanConfig& c, const std::vector<Sequence>& s, const CostModel& m)
      : c_(c),
        m_(m),
        walker_(c, s),
        g_(geometry(c)),
        dim_sum_(c.head_dim + c.head_dim_v),
        chunk_(c.deterministic ? kDeterministicChunkTiles : 0) {
    const int64_t batch = c.batch_size;
    base_.resize(batch + 1);
    seq_cost_.assign(batch, 0.0);
    cum_.assign(batch + 1, 0.0);
    int64_t entries = 0;
    for (int64_t b = 0; b < batch; ++b) {
      base_[b] = entries;
      entries += walker_.num_query_tiles(b) + 1;
    }
    base_[batch] = entries;
    unit_pre_.resize(entries);
    for (int64_t b = 0; b < batch; ++b) {
      double acc = 0;
      const int64_t n = walker_.num_query_tiles(b);
      for (int64_t t = 0; t < n; ++t) {
        unit_pre_[base_[b] + t] = acc;
        const TileSpan sp = walker_.span(b, t);
        const int64_t rows = rows_of(b, t);
        acc += task_cost(m_, rows, dim_sum_) + tiles_cost(sp, rows, sp.end - sp.begin);
        indivisible_ = std::max(indivisible_, smallest_first_piece(sp, rows));
        if (sp.end > sp.begin)
          min_block_ = std::min(min_block_, block_cost(m_, rows, dim_sum_, false));
      }
      unit_pre_[base_[b] + n] = acc;
      seq_cost_[b] = acc;
      cum_[b + 1] = cum_[b] + acc * static_cast<double>(c.num_heads_kv);
    }
  }

  const UnitWalker& walker() const { return walker_; }

  Plan run() {
    Plan plan;
    plan.geometry = g_;
    plan.chunk_tiles = chunk_;
    plan.total_cost = cum_.back();
    const double workers = static_cast<double>(c_.num_workers);
    plan.lower_bound = std::max(plan.total_cost / workers, indivisible_);
    if (plan.total_cost > 0) {
      // The smallest capacity for which the greedy fill places everything. A capacity of at
      // least the total always fits (one worker takes it all), so the raising loop ends.
      double lo = plan.lower_bound;
      double hi = lo;
      double left = fill(lo, nullptr);
      if (left > 0) {
        // Raise the capacity by what is left over, spread over every worker, until everything
        // fits; then bisect. Cuts fall on key tiles, so resolving the capacity more finely than a
        // fraction of the cheapest block changes nothing.
        hi = lo + left / workers;
        while ((left = fill(hi, nullptr)) > 0) {
          lo = hi;
          hi += left / workers + 0.5 * min_block_;
        }
        const double resolution = std::max(kCapacityTolerance * lo, 0.25 * min_block_);
        for (int it = 0; it < 40 && hi - lo > resolution; ++it) {
          const double mid = 0.5 * (lo + hi);
          (fill(mid, nullptr) > 0 ? lo : hi) = mid;
        }
      }
      fill(hi, &plan);
    } else {
      fill(0, &plan);
    }
    return plan;
  }

 private:
  int64_t rows_of(int64_t b, int64_t t) const {
    return (walker_.tile_end(b, t) - walker_.tile_begin(t)) * g_.group;
  }

  // Cost of the first n key tiles of a unit's span.
  double tiles_cost(const TileSpan& sp, int64_t rows, int64_t n) const {
    const int64_t full = std::max<int64_t>(
        0, std::min(sp.begin + n, sp.full_end) - std::max(sp.begin, sp.full_begin));
    return static_cast<double>(full) * block_cost(m_, rows, dim_sum_, false) +
           static_cast<double>(n - full) * block_cost(m_, rows, dim_sum_, true);
  }

  double smallest_first_piece(const TileSpan& sp, int64_t rows) const {
    const int64_t tiles = sp.end - sp.begin;
    int64_t n = std::min<int64_t>(tiles, 1);
    if (chunk_ > 0 && tiles > 0) n = std::min(tiles, chunk_ - sp.begin % chunk_);
    return task_cost(m_, rows, dim_sum_) + tiles_cost(sp, rows, n);
  }

  // What a piece that continues a split unit costs beyond its key tiles.
  double continuation_extra(int64_t rows) const {
    return task_cost(m_, rows, dim_sum_) + combine_cost(m_, rows, c_.head_dim_v);
  }

  // Cost coordinate of a position along the canonical order.
  double coord(const Position& p) const {
    if (walker_.is_end(p)) return cum_.back();
    double x = cum_[p.b] + p.h * seq_cost_[p.b] + unit_pre_[base_[p.b] + p.t];
    const TileSpan sp = walker_.span(p.b, p.t);
    if (p.k > sp.begin) {
      const int64_t rows = rows_of(p.b, p.t);
      x += task_cost(m_, rows, dim_sum_) + tiles_cost(sp, rows, p.k - sp.begin);
    }
    return x;
  }

  // The furthest allowed cut position whose coordinate is <= target.
  // `from` is a sequence at or before the answer: the search gallops forward from it, since
  // successive workers' cuts move forward through the batch.
  Position locate(double target, int64_t from = 0) const {
    if (target >= cum_.back()) return Position{static_cast<int32_t>(c_.batch_size), 0, 0, 0};
    int64_t lo = std::max<int64_t>(0, from), step = 1;
    while (lo + step < c_.batch_size && cum_[lo + step] <= target) {
      lo += step;
      step *= 2;
    }
    const auto window_end = cum_.begin() + std::min<int64_t>(c_.batch_size, lo + step) + 1;
    const int64_t b = std::upper_bound(cum_.begin() + lo, window_end, target) - cum_.begin() - 1;
    double rem = target - cum_[b];
    const int64_t h = std::min<int64_t>(c_.num_heads_kv - 1,
                                        static_cast<int64_t>(std::floor(rem / seq_cost_[b])));
    rem -= static_cast<double>(h) * seq_cost_[b];
    const int64_t n_tiles = walker_.num_query_tiles(b);
    const auto first = unit_pre_.begin() + base_[b];
    int64_t t = std::upper_bound(first, first + n_tiles + 1, rem) - first - 1;
    t = std::clamp<int64_t>(t, 0, n_tiles - 1);
    rem -= unit_pre_[base_[b] + t];
    const TileSpan sp = walker_.span(b, t);
    const int64_t rows = rows_of(b, t);
    const int64_t tiles = sp.end - sp.begin;
    int64_t n = 0;
    const double after_task = rem - task_cost(m_, rows, dim_sum_);
    if (after_task >= 0) {
      int64_t lo = 0, hi = tiles;  // largest n with tiles_cost(n) <= after_task
      while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (tiles_cost(sp, rows, mid) <= after_task) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      n = lo;
    }
    if (tiles > 0 && n >= tiles) {
      return walker_.next_unit(
          {static_cast<int32_t>(b), static_cast<int32_t>(h), static_cast<int32_t>(t), 0});
    }
    int64_t k = sp.begin + n;
    if (chunk_ > 0 && k > sp.begin) k = std::max(sp.begin, k / chunk_ * chunk_);
    return {static_cast<int32_t>(b), static_cast<int32_t>(h), static_cast<int32_t>(t),
            static_cast<int32_t>(k)};
  }

  // Greedy fill with `capacity` per worker; records the plan when `out` is given.
  // Returns the cost left unplaced (0 when everything fits).
  double fill(double capacity, Plan* out) const {
    Position cur = walker_.first_unit();
    double cur_x = 0;  // coordinate of cur
    for (int64_t w = 0; w < c_.num_workers; ++w) {
      const Position begin = cur;
      double extra = 0;
      if (walker_.mid_unit(cur)) extra = continuation_extra(rows_of(cur.b, cur.t));
      Position end = cur;
      double end_x = cur_x;
      if (!walker_.is_end(cur)) {
        if (w + 1 == c_.num_workers && out != nullptr) {
          end = walker_.end();
        } else {
          end = locate(cur_x + capacity - extra, cur.b);
          // A split costs the next worker a continuation; take a piece of a unit only when it is
          // worth more than that, else stop at the unit's start.
          if (walker_.mid_unit(end)) {
            const Position start = walker_.unit_start(end.b, end.h, end.t);
            const bool same = start.b == cur.b && start.h == cur.h && start.t == cur.t;
            const Position from = same ? cur : start;
            if (coord(end) - coord(from) < continuation_extra(rows_of(end.b, end.t)) &&
                !before(start, cur) && !same) {
              end = start;
            }
          }
        }
        if (before(end, cur)) end = cur;
        end_x = coord(end);
      }
      if (out != nullptr) record(begin, end, extra, *out);
      cur = end;
      cur_x = end_x;
    }
    return walker_.is_end(cur) ? 0.0 : std::max(cum_.back() - cur_x, 1e-9);
  }

  void record(const Position& begin, const Position& end, double extra, Plan& plan) const {
    WorkerRange r{begin, end, -1, -1, 0.0f};
    if (!(begin == end)) {
      r.cost = static_cast<float>(coord(end) - coord(begin) + extra);
      plan.num_tasks +=
          walker_.unit_index(end) - walker_.unit_index(begin) + (walker_.mid_unit(end) ? 1 : 0);
      const bool same_unit = begin.b == end.b && begin.h == end.h && begin.t == end.t;
      if (walker_.mid_unit(begin)) {
        // Continues a split unit: its partial result(s) join that unit's combine task.
        const TileSpan& sp = walker_.span(begin.b, begin.t);
        const int64_t k_to = same_unit ? end.k : sp.end;
        const int64_t slots = chunk_ > 0 ? (k_to - 1) / chunk_ - begin.k / chunk_ + 1 : 1;
        r.begin_slot = static_cast<int32_t>(plan.num_slots);
        plan.combines.back().num_slots += static_cast<int32_t>(slots);
        plan.num_slots += slots;
      }
      if (walker_.mid_unit(end) && !(same_unit && walker_.mid_unit(begin))) {
        plan.combines.push_back({end.b, end.h, end.t, static_cast<int32_t>(plan.num_slots), 1});
        r.end_slot = static_cast<int32_t>(plan.num_slots);
        plan.num_slots += 1;
      }
    }
    plan.workers.push_back(r);
    plan.makespan = std::max(plan.makespan, static_cast<double>(r.cost));
    if (plan.workers.size() == static_cast<size_t>(c_.num_workers)) {
      plan.num_tasks += static_cast<int64_t>(plan.combines.size());
    }
  }

  const PlanConfig& c_;
  const CostModel& m_;
  UnitWalker walker_;
  Geometry g_;
  int64_t dim_sum_;
  int64_t chunk_;
  std::vector<int64_t> base_;     // per sequence: offset of its entries in unit_pre_
  std::vector<double> unit_pre_;  // per sequence: exclusive prefix of unit costs over t (n + 1)
  std::vector<double> seq_cost_;  // cost of one key head of a sequence
  std::vector<double> cum_;       // exclusive prefix over sequences of num_heads_kv * seq_cost_
  double indivisible_ = 0;
  double min_block_ = std::numeric_limits<double>::infinity();
};

}  // namespace

Plan make_plan(const PlanConfig& config, const std::vector<Sequence>& sequences,
               const CostModel& model) {
  Planner planner(config, sequences, model);
  Plan plan = planner.run();
  verify_coverage(config, planner.walker(), plan);
  return plan;
}

void verify_coverage(const PlanConfig& config, const std::vector<Sequence>& sequences,
                     const Plan& plan) {
  verify_coverage(config, UnitWalker(config, sequences), plan);
}

void verify_coverage(const PlanConfig& config, const UnitWalker& walker, const Plan& plan) {
  auto fail = [](const std::string& what) {
    throw std::logic_error("the plan does not cover the work exactly once: " + what);
  };
  if (static_cast<int64_t>(plan.workers.size()) != config.num_workers) fail("worker count");
  const int64_t chunk = plan.chunk_tiles;
  Position expected = walker.first_unit();
  int64_t slots = 0;
  size_t combine = 0;
  bool open = false;  // a split unit awaits its remaining pieces
  for (const WorkerRange& r : plan.workers) {
    if (!(r.begin == expected)) fail("a worker does not start where the previous one ended");
    if (!walker.valid(r.end) || before(r.end, r.begin)) fail("a worker's end is not a cut point");
    const bool same_unit = r.begin.b == r.end.b && r.begin.h == r.end.h && r.begin.t == r.end.t;
    const bool empty = r.begin == r.end;
    if (!empty && walker.mid_unit(r.begin)) {
      if (!open || combine >= plan.combines.size()) fail("a continued unit has no combine task");
      const CombineTask& ct = plan.combines[combine];
      if (ct.b != r.begin.b || ct.h != r.begin.h || ct.t != r.begin.t) fail("combine order");
      if (r.begin_slot != slots) fail("slot of a continuing piece");
      const TileSpan& sp = walker.span(r.begin.b, r.begin.t);
      const int64_t k_to = same_unit ? r.end.k : sp.end;
      slots += chunk > 0 ? (k_to - 1) / chunk - r.begin.k / chunk + 1 : 1;
      if (k_to == sp.end) {
        if (slots != static_cast<int64_t>(ct.first_slot) + ct.num_slots) fail("slot count");
        open = false;
        ++combine;
      }
    } else if (r.begin_slot != -1) {
      fail("a piece that starts its unit has a continuation slot");
    }
    if (!empty && walker.mid_unit(r.end) && !(same_unit && walker.mid_unit(r.begin))) {
      if (open || combine >= plan.combines.size()) fail("a split unit has no combine task");
      const CombineTask& ct = plan.combines[combine];
      if (ct.b != r.end.b || ct.h != r.end.h || ct.t != r.end.t) fail("combine order");
      if (ct.first_slot != slots || r.end_slot != slots || ct.num_slots < 2) fail("slot numbering");
      slots += 1;
      open = true;
    } else if (r.end_slot != -1) {
      fail("a piece that finishes its unit has a prefix slot");
    }
    expected = r.end;
  }
  if (!walker.is_end(expected)) fail("work is left after the last worker");
  if (open || combine != plan.combines.size() || slots != plan.num_slots) {
    fail("combine tasks or slots left over");
  }
}

}  // namespace opmesh::core::attention
