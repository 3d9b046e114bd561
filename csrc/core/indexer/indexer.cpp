#include "indexer.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "../aligned_buffer.h"
#include "../attention/config.h"
#include "../attention/planner.h"
#include "../errors.h"
#include "../kernels/kernel_set.h"
#include "../kernels/row_loads.h"
#include "../online_softmax.h"
#include "packing.h"
#include "tiling.h"

namespace opmesh::core {
namespace {

using indexer::kKeyTile;

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

std::vector<Sequence> indexer_sequences(const IndexerParams& p) {
  QueryKeyLayout l;  // the sparse stage's sequences, with keys in the queries' layout
  l.layout_query = p.layout;
  l.batch = p.batch;
  l.seq_q = p.seq_q;
  l.seq_k = p.seq_k;
  l.seq_q_lens = p.seq_q_lens;
  l.seq_k_lens = p.seq_k_lens;
  std::vector<Sequence> seqs = query_key_sequences(l, p.layout);
  apply_residuals(p, seqs);
  return seqs;
}

namespace {

constexpr int64_t kMaxUnitPositions = 64;

// One worker's scratch, reused across its pieces: O(tile), independent of sequence length.
struct Scratch {
  Scratch(int64_t groups, int64_t rows, int64_t depth, int64_t words)
      : query(groups * rows * depth),
        key(depth * kKeyTile),
        weights(rows * groups),
        scores(rows * kKeyTile),
        row(2 * words),
        stats(3 * rows) {}
  AlignedBuffer<uint32_t> query;  // [groups][rows][depth] words
  AlignedBuffer<uint32_t> key;    // [depth][kKeyTile] words
  AlignedBuffer<float> weights;   // [rows][groups]
  AlignedBuffer<float> scores;    // [rows][kKeyTile]
  AlignedBuffer<float> row;       // one converted key row
  std::vector<SoftmaxStats> stats;
};

// The work is planned by the same planner as flash attention's: a unit is (sequence, key head g,
// tile of query positions) and its key tiles; the group's query heads are summed inside each
// score, so a unit's rows are query positions (the planner sees one query head per key head).
// A unit split over workers leaves partial statistics in slots that a combine task merges.
// Query positions per unit: the packed queries of a unit (groups x positions x depth words) are
// read once per key tile, so they should stay in a core's L2 cache (budget 1 MiB); 16 to 64.
int64_t unit_positions(int64_t groups, int64_t depth_words) {
  constexpr int64_t kBudgetBytes = int64_t{1} << 20;
  const int64_t fit = kBudgetBytes / (groups * depth_words * 4) / 16 * 16;
  return std::clamp<int64_t>(fit, 16, kMaxUnitPositions);
}

attention::PlanConfig plan_config(const IndexerParams& p, const std::vector<Sequence>& seqs,
                                  int64_t workers, int64_t depth_words) {
  attention::PlanConfig c;
  c.tile_positions = unit_positions(p.heads_q / p.heads_k, depth_words);
  c.num_heads_q = c.num_heads_kv = p.heads_k;
  c.head_dim = p.head_dim;
  c.head_dim_v = 1;  // the state of a row is two floats, not an output vector
  c.batch_size = p.batch;
  for (const Sequence& s : seqs) {
    c.max_seqlen_q = std::max(c.max_seqlen_q, s.q_len);
    c.max_seqlen_kv = std::max(c.max_seqlen_kv, s.k_len);
  }
  const Mask mask = indexer_mask(p.sparse_mode, p.pre_tokens, p.next_tokens);
  c.mask_mode = mask.mode;
  c.win_left = mask.left;
  c.win_right = mask.right;
  c.layout_q = c.layout_kv = c.layout_out = p.layout;
  c.cmp_ratio = p.cmp_ratio;
  c.num_workers = workers;
  // Units split only at fixed key chunks, whose statistics merge in a fixed order: the result
  // is the same, bit for bit, whatever the worker and thread counts.
  c.deterministic = true;
  return c;
}

// Flash attention's cost model with the work per row and per key scaled by the group: a score of
// the indexer takes `groups` dot products of D. (Not calibrated on the indexer itself.)
attention::CostModel cost_model(const IndexerParams& p, const kernels::KernelSet& set) {
  attention::CostModel m = attention::cost_model_for(set);
  const double groups = static_cast<double>(p.heads_q / p.heads_k);
  m.mac_ns *= groups;
  m.row_ns *= groups;  // packing a row packs every head of its group
  return m;
}

indexer::Operands operands(const IndexerParams& p) {
  const bool batched = p.layout == Layout::kBSND;
  return indexer::operands_of(p, batched, batched);
}

class IndexerRun {
 public:
  IndexerRun(const IndexerParams& p, Isa isa, int64_t workers)
      : p_(p),
        groups_(p.heads_q / p.heads_k),
        set_(kernels::select_set(isa, p.qk_dtype, p.bf16_pairs, true)),
        operands_(operands(p)),
        packer_(operands_, set_),
        sequences_(indexer_sequences(p)),
        config_(plan_config(p, sequences_, workers, packer_.depth())),
        plan_(attention::make_plan(config_, sequences_, cost_model(p, set_))),
        walker_(config_, sequences_),
        rows_(kernels::round_up(plan_.geometry.positions, set_.row_align)),
        mask_(compressed(indexer_mask(p.sparse_mode, p.pre_tokens, p.next_tokens), p)) {}

  const attention::Plan& plan() const { return plan_; }
  const attention::UnitWalker& walker() const { return walker_; }
  const kernels::KernelSet& kernel_set() const { return set_; }
  std::unique_ptr<Scratch> make_scratch() const {
    return std::make_unique<Scratch>(groups_, rows_, packer_.depth(), packer_.words());
  }

  // Key tiles [k_from, k_to) of unit (b, g, t); `slots` holds the partial statistics of split
  // units, rows_ per slot.
  void piece(Scratch& sc, int32_t b, int32_t g, int32_t t, int32_t k_from, int32_t k_to,
             const attention::TileSpan& sp, const attention::WorkerRange& range,
             SoftmaxStats* slots) const {
    const Sequence& seq = sequences_[b];
    const int64_t p0 = walker_.tile_begin(t);
    const int rows = static_cast<int>(walker_.tile_end(b, t) - p0);
    const bool first = k_from == sp.begin;
    const bool last = k_to == sp.end;
    // cur: the current key chunk; run: the chunks of a unit's first piece, merged in order.
    SoftmaxStats* cur = sc.stats.data();
    SoftmaxStats* run = cur + rows_;
    std::fill(cur, cur + rows, SoftmaxStats{});
    std::fill(run, run + rows, SoftmaxStats{});
    int32_t next_slot = range.begin_slot;
    bool pending = false;
    auto flush = [&] {
      if (first) {
        for (int r = 0; r < rows; ++r) run[r] = merge(run[r], cur[r]);
      } else {
        std::copy(cur, cur + rows, slots + next_slot++ * rows_);
      }
      std::fill(cur, cur + rows, SoftmaxStats{});
      pending = false;
    };
    if (k_to > k_from) {
      KeyRange row_keys[kMaxUnitPositions];
      for (int r = 0; r < rows; ++r) row_keys[r] = visible_keys(mask_, seq, p0 + r);
      packer_.pack_queries(seq, p0, rows, g, rows_, sc.query.data(), sc.weights.data());
      int row_begin = 0;
      for (int64_t j = k_from; j < k_to; ++j) {
        if (pending && j % plan_.chunk_tiles == 0) flush();
        pending = true;
        const int64_t j0 = j * kKeyTile;
        const int row_end = indexer::rows_seeing_tile(row_keys, rows, j0, row_begin);
        if (row_begin == row_end) continue;
        packer_.score_rows(sc, seq, g, j0, rows_, row_begin, row_end);
        for (int r = row_begin; r < row_end; ++r) {
          const int64_t lo = std::max<int64_t>(row_keys[r].begin - j0, 0);
          const int64_t hi = std::min<int64_t>(kKeyTile, row_keys[r].end - j0);
          if (hi > lo) {
            absorb(cur[r], sc.scores.data() + r * kKeyTile + lo, static_cast<int>(hi - lo));
          }
        }
      }
    }
    if (pending) flush();
    if (first && last) {
      write(seq, g, p0, rows, run);
    } else if (first) {
      std::copy(run, run + rows, slots + range.end_slot * rows_);
    }
  }

  void combine(Scratch& sc, const attention::CombineTask& ct, const SoftmaxStats* slots) const {
    const int64_t p0 = walker_.tile_begin(ct.t);
    const int rows = static_cast<int>(walker_.tile_end(ct.b, ct.t) - p0);
    SoftmaxStats* stats = sc.stats.data() + 2 * rows_;
    std::fill(stats, stats + rows, SoftmaxStats{});
    for (int32_t s = 0; s < ct.num_slots; ++s) {
      const SoftmaxStats* part = slots + (ct.first_slot + s) * rows_;
      for (int r = 0; r < rows; ++r) stats[r] = merge(stats[r], part[r]);
    }
    write(sequences_[ct.b], ct.h, p0, rows, stats);
  }

  int64_t slot_rows() const { return rows_; }

 private:
  void write(const Sequence& seq, int64_t g, int64_t p0, int rows,
             const SoftmaxStats* stats) const {
    const int64_t out = output_offset(seq, g) + p0;
    for (int r = 0; r < rows; ++r) {
      p_.softmax_max[out + r] = stats[r].max;
      p_.softmax_sum[out + r] = stats[r].sum;
    }
  }

  int64_t output_offset(const Sequence& seq, int64_t g) const {
    if (p_.layout == Layout::kTND) return g * p_.seq_q + seq.q_begin;
    return (seq.batch * p_.heads_k + g) * p_.seq_q;
  }

  const IndexerParams& p_;
  int64_t groups_;
  const kernels::KernelSet& set_;
  indexer::Operands operands_;
  indexer::Packer packer_;
  std::vector<Sequence> sequences_;
  attention::PlanConfig config_;
  attention::Plan plan_;
  attention::UnitWalker walker_;
  int64_t rows_;  // query positions per unit, padded to the set's row_align
  Mask mask_;
};

}  // namespace

void validate(const IndexerParams& p) {
  if (p.layout != Layout::kBSND && p.layout != Layout::kTND) {
    throw ArgumentError("layout", "expected BSND or TND");
  }
  indexer_mask(p.sparse_mode, p.pre_tokens, p.next_tokens);
  validate(static_cast<const Compression&>(p), p.batch, p.pre_tokens, p.next_tokens);
  if (p.batch < 0) throw ArgumentError("batch", "must be >= 0, got " + str(p.batch));
  if (p.seq_q < 0 || p.seq_k < 0) throw ArgumentError("query_index", "negative sequence size");
  // The same head and head-dim limits as flash attention: they bound every scratch size.
  if (p.heads_q < 1 || p.heads_q > attention::kMaxHeads) {
    throw ArgumentError("query_index", "N1 must be in [1, " + str(attention::kMaxHeads) +
                                           "], got " + str(p.heads_q));
  }
  if (p.heads_k < 1 || p.heads_k > attention::kMaxHeads) {
    throw ArgumentError(
        "key_index", "N2 must be in [1, " + str(attention::kMaxHeads) + "], got " + str(p.heads_k));
  }
  if (p.head_dim > attention::kMaxHeadDim) {
    throw ArgumentError("query_index", "head dim D must be <= " + str(attention::kMaxHeadDim) +
                                           ", got " + str(p.head_dim));
  }
  if (p.heads_q % p.heads_k != 0) {
    throw ArgumentError("key_index", "query heads N1=" + str(p.heads_q) +
                                         " must be a multiple of key heads N2=" + str(p.heads_k));
  }
  if (p.head_dim < 1) throw ArgumentError("query_index", "head dim D must be >= 1");
  if (p.weights_dtype != p.qk_dtype && p.weights_dtype != DType::kFloat32) {
    throw ArgumentError("weights", std::string("dtype must be ") + dtype_name(p.qk_dtype) +
                                       " or float32, got " + dtype_name(p.weights_dtype));
  }
  if (p.seq_q > attention::kMaxTokens || p.seq_k > attention::kMaxTokens) {
    throw ArgumentError(p.seq_q > attention::kMaxTokens ? "query_index" : "key_index",
                        "at most " + str(attention::kMaxTokens) + " tokens per sequence dim");
  }
  if (p.batch > attention::kMaxBatch) {
    throw ArgumentError("query_index", "batch must be <= " + str(attention::kMaxBatch));
  }
  if (p.layout == Layout::kTND && p.batch == 0 && (p.seq_q != 0 || p.seq_k != 0)) {
    throw ArgumentError("actual_seq_qlen", "is empty but the inputs hold tokens");
  }
  check_indexer_lengths(p.seq_q_lens, p.batch, p.seq_q, p.layout == Layout::kTND,
                        "actual_seq_qlen");
  check_indexer_lengths(p.seq_k_lens, p.batch, p.seq_k, p.layout == Layout::kTND,
                        "actual_seq_klen");
}

void dense_lightning_indexer_softmax_lse(const IndexerParams& p, const Executor& executor,
                                         Isa isa) {
  validate(p);
  require_supported(isa);
  const int64_t out_rows = p.layout == Layout::kTND ? p.seq_q : p.batch * p.seq_q;
  // Rows no task visits (BSND padding past a sequence's length) keep the empty-row value.
  std::fill(p.softmax_max, p.softmax_max + out_rows * p.heads_k,
            -std::numeric_limits<float>::infinity());
  std::fill(p.softmax_sum, p.softmax_sum + out_rows * p.heads_k, 0.0f);

  const int threads = std::max(1, executor.num_workers());
  // Four logical workers per thread: pulled dynamically, they absorb the cost model's errors.
  const IndexerRun run(p, isa, int64_t{4} * threads);
  const attention::Plan& plan = run.plan();
  std::vector<SoftmaxStats> slots(plan.num_slots * run.slot_rows());
  std::vector<std::unique_ptr<Scratch>> scratch(threads);
  auto scratch_of = [&](int thread) -> Scratch& {
    if (!scratch[thread]) scratch[thread] = run.make_scratch();
    return *scratch[thread];
  };
  run_dynamic(executor, static_cast<int64_t>(plan.workers.size()), [&](int64_t w, int thread) {
    Scratch& sc = scratch_of(thread);
    const kernels::WorkerScope scope(run.kernel_set());
    const attention::WorkerRange& range = plan.workers[w];
    run.walker().for_each_piece(range.begin, range.end,
                                [&](int32_t b, int32_t g, int32_t t, int32_t k_from, int32_t k_to,
                                    const attention::TileSpan& sp) {
                                  run.piece(sc, b, g, t, k_from, k_to, sp, range, slots.data());
                                });
  });
  run_dynamic(executor, static_cast<int64_t>(plan.combines.size()), [&](int64_t c, int thread) {
    run.combine(scratch_of(thread), plan.combines[c], slots.data());
  });
}

}  // namespace opmesh::core
