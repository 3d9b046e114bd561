#include "indexer.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "aligned_buffer.h"
#include "attention/config.h"
#include "errors.h"
#include "indexer_tiling.h"
#include "kernels/kernel_set.h"
#include "online_softmax.h"
#include "row_loads.h"

namespace opmesh::core {
namespace {

using indexer::kKeyTile;
using indexer::kQueryTile;

std::string str(int64_t v) { return std::to_string(v); }

void check_lengths(const int64_t* lens, int64_t batch, int64_t total, Layout layout,
                   const char* name) {
  if (layout == Layout::kTND) {
    // An empty batch has no lengths to give; then no tokens may be present either.
    if (lens == nullptr && batch > 0) throw ArgumentError(name, "is required for layout TND");
    int64_t prev = 0;
    for (int64_t b = 0; b < batch; ++b) {
      if (lens[b] < prev) {
        throw ArgumentError(name, "cumulative lengths must be non-decreasing and >= 0, but entry " +
                                      str(b) + " is " + str(lens[b]) + " after " + str(prev));
      }
      prev = lens[b];
    }
    if (prev != total) {
      throw ArgumentError(name, "last cumulative length must equal the token count " + str(total) +
                                    ", got " + str(prev));
    }
    return;
  }
  if (lens == nullptr) return;
  for (int64_t b = 0; b < batch; ++b) {
    if (lens[b] < 0 || lens[b] > total) {
      throw ArgumentError(name, "entry " + str(b) + " is " + str(lens[b]) +
                                    ", expected a length in [0, " + str(total) + "]");
    }
  }
}

std::vector<Sequence> make_sequences(const IndexerParams& p) {
  std::vector<Sequence> out(p.batch);
  for (int64_t b = 0; b < p.batch; ++b) {
    Sequence& s = out[b];
    s.batch = b;
    if (p.layout == Layout::kTND) {
      s.q_begin = b == 0 ? 0 : p.seq_q_lens[b - 1];
      s.k_begin = b == 0 ? 0 : p.seq_k_lens[b - 1];
      s.q_len = p.seq_q_lens[b] - s.q_begin;
      s.k_len = p.seq_k_lens[b] - s.k_begin;
    } else {
      s.q_len = p.seq_q_lens ? p.seq_q_lens[b] : p.seq_q;
      s.k_len = p.seq_k_lens ? p.seq_k_lens[b] : p.seq_k;
    }
  }
  return out;
}

// One worker's scratch, reused across its tasks: O(tile), independent of sequence length.
struct Scratch {
  Scratch(int64_t groups, int64_t depth, int64_t words)
      : query(groups * kQueryTile * depth),
        key(depth * kKeyTile),
        weights(kQueryTile * groups),
        scores(kQueryTile * kKeyTile),
        row(2 * words) {}
  AlignedBuffer<uint32_t> query;  // [groups][kQueryTile][depth] words
  AlignedBuffer<uint32_t> key;    // [depth][kKeyTile] words
  AlignedBuffer<float> weights;   // [kQueryTile][groups]
  AlignedBuffer<float> scores;    // [kQueryTile][kKeyTile]
  AlignedBuffer<float> row;       // one converted key row
};

class IndexerRun {
 public:
  IndexerRun(const IndexerParams& p, Isa isa)
      : p_(p),
        groups_(p.heads_q / p.heads_k),
        set_(kernels::select_set(isa, p.qk_dtype, p.bf16_pairs, true)),
        bf16_pairs_(set_.word == kernels::Word::kBf16Pair),
        words_(bf16_pairs_ ? (p.head_dim + 1) / 2 : p.head_dim),
        depth_(kernels::round_up(words_, set_.depth_align)),
        sequences_(make_sequences(p)) {
    static_assert(kQueryTile % 16 == 0, "query tiles hold whole 16-row tiles");
    if (kQueryTile % set_.row_align != 0) {
      throw ArgumentError(
          "isa", std::string(set_.name) + " needs rows in multiples of " + str(set_.row_align));
    }
  }

  const std::vector<Sequence>& sequences() const { return sequences_; }
  int64_t groups() const { return groups_; }
  int64_t depth() const { return depth_; }
  int64_t words() const { return words_; }
  const kernels::KernelSet& kernel_set() const { return set_; }

  void run_task(const indexer::Task& task, Scratch& scratch) const {
    const Sequence& seq = sequences_[task.sequence];
    const int rows = static_cast<int>(task.row_end - task.row_begin);
    int64_t row_key_end[kQueryTile];
    for (int r = 0; r < rows; ++r) {
      row_key_end[r] = indexer::visible_key_end(p_.sparse_mode, seq, task.row_begin + r);
    }
    const int64_t tile_key_end = row_key_end[rows - 1];
    for (int64_t g = 0; g < p_.heads_k; ++g) {
      SoftmaxStats stats[kQueryTile];
      if (tile_key_end > 0) {
        pack_queries(seq, task, g, scratch);
        int row_begin = 0;
        for (int64_t j0 = 0; j0 < tile_key_end; j0 += kKeyTile) {
          // Rows are ordered by visible range: skip the prefix that sees none of this tile.
          while (row_begin < rows && row_key_end[row_begin] <= j0) ++row_begin;
          pack_keys(seq, g, j0, std::min<int64_t>(kKeyTile, seq.k_len - j0), scratch);
          std::fill(scratch.scores.data() + row_begin * kKeyTile,
                    scratch.scores.data() + rows * kKeyTile, 0.0f);
          const kernels::ScoreTileArgs args{scratch.query.data(),
                                            kQueryTile,
                                            scratch.key.data(),
                                            scratch.weights.data(),
                                            scratch.scores.data(),
                                            row_begin,
                                            rows,
                                            static_cast<int>(groups_),
                                            depth_};
          set_.score_tile(args);
          for (int r = row_begin; r < rows; ++r) {
            const int64_t n = std::min<int64_t>(kKeyTile, row_key_end[r] - j0);
            absorb(stats[r], scratch.scores.data() + r * kKeyTile, static_cast<int>(n));
          }
        }
      }
      const int64_t out = output_offset(seq, g) + task.row_begin;
      for (int r = 0; r < rows; ++r) {
        p_.softmax_max[out + r] = stats[r].max;
        p_.softmax_sum[out + r] = stats[r].sum;
      }
    }
  }

 private:
  int64_t output_offset(const Sequence& seq, int64_t g) const {
    if (p_.layout == Layout::kTND) return g * p_.seq_q + seq.q_begin;
    return (seq.batch * p_.heads_k + g) * p_.seq_q;
  }

  int64_t batch_offset(const int64_t* stride, const Sequence& seq) const {
    return p_.layout == Layout::kBSND ? seq.batch * stride[0] : 0;
  }

  void pack_queries(const Sequence& seq, const indexer::Task& task, int64_t g,
                    Scratch& scratch) const {
    const int64_t* qs = p_.query_stride;
    const int64_t* ws = p_.weights_stride;
    const int rows = static_cast<int>(task.row_end - task.row_begin);
    for (int64_t h = 0; h < groups_; ++h) {
      const int64_t head = g * groups_ + h;
      for (int r = 0; r < rows; ++r) {
        const int64_t token = seq.q_begin + task.row_begin + r;
        const int64_t offset = batch_offset(qs, seq) + token * qs[1] + head * qs[2];
        uint32_t* dst = scratch.query.data() + (h * kQueryTile + r) * depth_;
        if (bf16_pairs_) {
          load_row_bf16_pairs(p_.query, offset, qs[3], p_.head_dim, dst);
        } else {
          load_row(p_.query, p_.qk_dtype, offset, qs[3], p_.head_dim,
                   reinterpret_cast<float*>(dst));
        }
        std::fill(dst + words_, dst + depth_, 0u);
        const int64_t w_offset = batch_offset(ws, seq) + token * ws[1] + head * ws[2];
        load_row(p_.weights, p_.weights_dtype, w_offset, 1, 1,
                 scratch.weights.data() + r * groups_ + h);
      }
    }
  }

  // Transposes keys [j0, j0 + count) of key head g into [depth][kKeyTile], zero-filling the rest.
  void pack_keys(const Sequence& seq, int64_t g, int64_t j0, int64_t count,
                 Scratch& scratch) const {
    const int64_t* ks = p_.key_stride;
    uint32_t* dst = scratch.key.data();
    if (count < kKeyTile) std::fill(dst, dst + depth_ * kKeyTile, 0u);
    uint32_t* row = reinterpret_cast<uint32_t*>(scratch.row.data());
    for (int64_t j = 0; j < count; ++j) {
      const int64_t offset = batch_offset(ks, seq) + (seq.k_begin + j0 + j) * ks[1] + g * ks[2];
      if (bf16_pairs_) {
        load_row_bf16_pairs(p_.key, offset, ks[3], p_.head_dim, row);
      } else {
        load_row(p_.key, p_.qk_dtype, offset, ks[3], p_.head_dim, reinterpret_cast<float*>(row));
      }
      for (int64_t l = 0; l < words_; ++l) dst[l * kKeyTile + j] = row[l];
    }
    if (count == kKeyTile) std::fill(dst + words_ * kKeyTile, dst + depth_ * kKeyTile, 0u);
  }

  const IndexerParams& p_;
  int64_t groups_;
  const kernels::KernelSet& set_;
  bool bf16_pairs_;
  int64_t words_;  // packed words per row
  int64_t depth_;  // words_ padded to the set's depth_align (zero words)
  std::vector<Sequence> sequences_;
};

}  // namespace

void validate(const IndexerParams& p) {
  if (p.layout != Layout::kBSND && p.layout != Layout::kTND) {
    throw ArgumentError("layout", "expected BSND or TND");
  }
  if (p.sparse_mode != MaskMode::kNone && p.sparse_mode != MaskMode::kCausal) {
    throw ArgumentError("sparse_mode", "expected 0 (no mask) or 3 (causal), got " +
                                           str(static_cast<int>(p.sparse_mode)));
  }
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
  if (p.layout == Layout::kTND && p.batch == 0 && (p.seq_q != 0 || p.seq_k != 0)) {
    throw ArgumentError("actual_seq_qlen", "is empty but the inputs hold tokens");
  }
  check_lengths(p.seq_q_lens, p.batch, p.seq_q, p.layout, "actual_seq_qlen");
  check_lengths(p.seq_k_lens, p.batch, p.seq_k, p.layout, "actual_seq_klen");
}

void dense_lightning_indexer_softmax_lse(const IndexerParams& p, const Executor& executor,
                                         Isa isa) {
  validate(p);
  if (!isa_supported(isa)) {
    throw ArgumentError("isa", std::string(isa_name(isa)) + " is not supported by this CPU");
  }
  const int64_t out_rows = p.layout == Layout::kTND ? p.seq_q : p.batch * p.seq_q;
  // Rows no task visits (BSND padding past a sequence's length) keep the empty-row value.
  std::fill(p.softmax_max, p.softmax_max + out_rows * p.heads_k,
            -std::numeric_limits<float>::infinity());
  std::fill(p.softmax_sum, p.softmax_sum + out_rows * p.heads_k, 0.0f);

  const IndexerRun run(p, isa);
  const std::vector<indexer::Task> tasks =
      indexer::make_tasks(run.sequences(), p.sparse_mode, kQueryTile);
  if (tasks.empty()) return;
  const int workers = std::max(1, executor.num_workers());
  std::vector<std::unique_ptr<Scratch>> scratch(workers);
  run_dynamic(executor, static_cast<int64_t>(tasks.size()), [&](int64_t t, int worker) {
    if (!scratch[worker]) {
      scratch[worker] = std::make_unique<Scratch>(run.groups(), run.depth(), run.words());
    }
    const kernels::WorkerScope scope(run.kernel_set());
    run.run_task(tasks[t], *scratch[worker]);
  });
}

}  // namespace opmesh::core
