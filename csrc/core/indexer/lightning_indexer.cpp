#include "lightning_indexer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "../aligned_buffer.h"
#include "../attention/config.h"
#include "../errors.h"
#include "../kernels/kernel_set.h"
#include "indexer.h"
#include "packing.h"

namespace opmesh::core {
namespace {

using kernels::kKeyTile;

std::string str(int64_t v) { return std::to_string(v); }

// A candidate as one unsigned word whose order is the selection's: the score's order bits above
// (NaN above +inf, -0 equal to +0), the complement of the position below (so that of two equal
// scores the lower position ranks higher). Positions are below 2^31.
inline uint64_t candidate(float score, int64_t position) {
  uint32_t bits;
  if (score != score) {
    bits = 0xffffffffu;
  } else {
    if (score == 0.0f) score = 0.0f;
    std::memcpy(&bits, &score, sizeof(bits));
    bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  }
  return (static_cast<uint64_t>(bits) << 32) | (0xffffffffu - static_cast<uint32_t>(position));
}

inline int32_t position_of(uint64_t c) {
  return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(c));
}

inline float score_of(uint64_t c) {
  const uint32_t key = static_cast<uint32_t>(c >> 32);
  if (key == 0xffffffffu) return std::numeric_limits<float>::quiet_NaN();
  const uint32_t bits = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Sorts c[0..n) in descending order through tmp (n entries): least significant byte first, each
// pass stable, a pass skipped where every word has the same byte (the high bits of positions).
void sort_descending(uint64_t* c, int64_t n, uint64_t* tmp) {
  if (n < 64) {
    std::sort(c, c + n, std::greater<uint64_t>());
    return;
  }
  uint64_t* from = c;
  uint64_t* to = tmp;
  for (int shift = 0; shift < 64; shift += 8) {
    int64_t count[256] = {};
    for (int64_t i = 0; i < n; ++i) ++count[255 - ((from[i] >> shift) & 0xff)];
    if (count[255 - ((from[0] >> shift) & 0xff)] == n) continue;
    int64_t at = 0;
    for (int64_t& b : count) {
      const int64_t size = b;
      b = at;
      at += size;
    }
    for (int64_t i = 0; i < n; ++i) to[count[255 - ((from[i] >> shift) & 0xff)]++] = from[i];
    std::swap(from, to);
  }
  if (from != c) std::copy(from, from + n, c);
}

// Moves the k largest of the n distinct words c[0..n) (1 <= k <= n) to the front, in their
// order, and returns the smallest of them. tmp: n entries. The k-th largest is found a byte at a
// time from the most significant: each pass counts one byte of the words still in question and
// keeps those in the bucket the k-th largest falls in. Counting and copying without branches on
// the data, it runs several times faster than a partition around pivots.
uint64_t keep_best(uint64_t* c, int64_t n, int64_t k, uint64_t* tmp) {
  const uint64_t* from = c;
  int64_t m = n;     // words still in question
  int64_t need = k;  // the k-th largest's rank among them (1: the largest)
  for (int shift = 56; shift >= 0 && m > 1; shift -= 8) {
    int64_t count[256] = {};
    for (int64_t i = 0; i < m; ++i) ++count[(from[i] >> shift) & 0xff];
    uint64_t bucket = 255;
    while (count[bucket] < need) need -= count[bucket--];
    int64_t kept = 0;
    for (int64_t i = 0; i < m; ++i) {
      const uint64_t x = from[i];
      tmp[kept] = x;
      kept += ((x >> shift) & 0xff) == bucket ? 1 : 0;
    }
    from = tmp;
    m = kept;
  }
  const uint64_t kth = from[0];  // distinct words: one is left
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t x = c[i];
    c[kept] = x;
    kept += x >= kth ? 1 : 0;
  }
  return kth;
}

// Keeps the best k of n candidates at the front of c, in descending order; returns how many.
// tmp: n entries.
int64_t select_sorted(uint64_t* c, int64_t n, int64_t k, uint64_t* tmp) {
  if (n > k) {
    keep_best(c, n, k, tmp);
    n = k;
  }
  sort_descending(c, n, tmp);
  return n;
}

// A query tile of one sequence and key head, and the keys its rows see.
struct Unit {
  int32_t b, g;
  int64_t p0;         // first query position
  int32_t rows;       // query positions
  int64_t lo, hi;     // the union of the rows' visible keys
  int32_t chunks;     // key chunks, each a task; > 1 leaves candidates in slots to merge
  int64_t slot_base;  // first slot row (chunks > 1)
};

struct Task {
  int32_t unit;
  int32_t chunk;
  int64_t cost;
};

class TopKRun {
 public:
  TopKRun(const LightningIndexerParams& p, Isa isa, int threads)
      : p_(p),
        groups_(p.heads_q / p.heads_k),
        k_(p.sparse_count),
        cap_(p.sparse_count + p.sparse_count / 2 + kKeyTile),
        set_(kernels::select_set(isa, p.qk_dtype, p.bf16_pairs, true)),
        operands_(operands(p)),
        packer_(operands_, set_),
        mask_(compressed(indexer_mask(p.sparse_mode, p.pre_tokens, p.next_tokens), p)),
        seqs_(lightning_indexer_sequences(p)),
        positions_(unit_positions()),
        rows_(kernels::round_up(positions_, set_.row_align)) {
    plan(threads);
  }

  struct Scratch {
    Scratch(const TopKRun& r)
        : query(r.groups_ * r.rows_ * r.packer_.depth()),
          key(r.packer_.depth() * kKeyTile),
          weights(r.rows_ * r.groups_),
          scores(r.rows_ * kKeyTile),
          row(r.packer_.row_words()),
          best(r.rows_ * r.cap_),
          sort(r.cap_),
          count(r.rows_),
          floor(r.rows_),
          limit(r.rows_) {}
    AlignedBuffer<uint32_t> query;  // [groups][rows][depth] words
    AlignedBuffer<uint32_t> key;    // [depth][kKeyTile] words
    AlignedBuffer<float> weights;   // [rows][groups]
    AlignedBuffer<float> scores;    // [rows][kKeyTile]
    AlignedBuffer<float> row;
    AlignedBuffer<uint64_t> best;  // [rows][cap] candidates of each row
    AlignedBuffer<uint64_t> sort;  // [cap] the final sort's other buffer
    std::vector<int64_t> count;    // candidates held per row
    std::vector<uint64_t> floor;   // per row: a candidate must rank above it to be kept
    std::vector<float> limit;      // per row: floor's score (NaN: no floor yet)
  };

  const std::vector<Task>& tasks() const { return tasks_; }
  const std::vector<int32_t>& merges() const { return merges_; }
  const kernels::KernelSet& kernel_set() const { return set_; }

  void run_task(Scratch& sc, const Task& task) {
    const Unit& u = units_[task.unit];
    const Sequence& seq = seqs_[u.b];
    std::fill(sc.count.begin(), sc.count.begin() + u.rows, 0);
    std::fill(sc.floor.begin(), sc.floor.begin() + u.rows, 0);
    std::fill(sc.limit.begin(), sc.limit.begin() + u.rows, std::numeric_limits<float>::quiet_NaN());
    KeyRange keys[kernels::kKeyTile];
    for (int r = 0; r < u.rows; ++r) keys[r] = visible_keys(mask_, seq, u.p0 + r);
    // The chunk's share of the key tiles the unit touches (tile j: keys [64 j, 64 j + 64)).
    const int64_t first = u.lo / kKeyTile;
    const int64_t tiles = tile_count(u);
    const int64_t tile_lo = first + tiles * task.chunk / u.chunks;
    const int64_t tile_hi = first + tiles * (task.chunk + 1) / u.chunks;
    if (tile_hi > tile_lo) {
      packer_.pack_queries(seq, u.p0, u.rows, u.g, rows_, sc.query.data(), sc.weights.data());
    }
    int row_begin = 0;
    for (int64_t j = tile_lo; j < tile_hi; ++j) {
      const int64_t j0 = j * kKeyTile;
      const int row_end = indexer::rows_seeing_tile(keys, u.rows, j0, row_begin);
      if (row_begin == row_end) continue;
      packer_.score_rows(sc, seq, u.g, j0, rows_, row_begin, row_end);
      for (int r = row_begin; r < row_end; ++r) {
        const int64_t lo = std::max<int64_t>(keys[r].begin - j0, 0);
        const int64_t hi = std::min<int64_t>(kKeyTile, keys[r].end - j0);
        absorb(sc, r, sc.scores.data() + r * kKeyTile, j0, lo, hi);
      }
    }
    for (int r = 0; r < u.rows; ++r) {
      uint64_t* best = sc.best.data() + r * cap_;
      const int64_t n = select_sorted(best, sc.count[r], k_, sc.sort.data());
      if (u.chunks == 1) {
        write(u, r, best, n);
      } else {
        const int64_t slot = u.slot_base + task.chunk * u.rows + r;
        std::copy(best, best + n, slots_.data() + slot * k_);
        slot_counts_[slot] = n;
      }
    }
  }

  // Merges the chunks' candidates of a split unit.
  void merge(const Unit& u, std::vector<uint64_t>& buffer) {
    buffer.resize(2 * static_cast<size_t>(u.chunks) * k_);
    uint64_t* tmp = buffer.data() + static_cast<size_t>(u.chunks) * k_;
    for (int r = 0; r < u.rows; ++r) {
      int64_t n = 0;
      for (int32_t c = 0; c < u.chunks; ++c) {
        const int64_t slot = u.slot_base + c * u.rows + r;
        const uint64_t* src = slots_.data() + slot * k_;
        std::copy(src, src + slot_counts_[slot], buffer.data() + n);
        n += slot_counts_[slot];
      }
      write(u, r, buffer.data(), select_sorted(buffer.data(), n, k_, tmp));
    }
  }

  const Unit& unit(int32_t i) const { return units_[i]; }

 private:
  static indexer::Operands operands(const LightningIndexerParams& p) {
    indexer::Operands o =
        indexer::operands_of(p, p.layout_query == Layout::kBSND, p.layout_key == Layout::kBSND);
    if (p.layout_key == Layout::kPagedBBND) {
      o.block_table = p.block_table;
      o.block_table_stride = p.max_blocks;
      o.block_size = p.block_size;
    }
    return o;
  }

  static int64_t tile_count(const Unit& u) {
    return u.hi > u.lo ? (u.hi - 1) / kKeyTile - u.lo / kKeyTile + 1 : 0;
  }

  // Query positions per unit: the packed queries (groups x positions x depth words) stay in a
  // core's L2 cache (1 MiB), and the candidate buffers (positions x cap) within 32 MiB.
  int64_t unit_positions() const {
    const int64_t by_cache = (int64_t{1} << 20) / (groups_ * packer_.depth() * 4);
    const int64_t by_candidates = (int64_t{32} << 20) / (cap_ * 8);
    return std::clamp<int64_t>(std::min(by_cache, by_candidates), 1, kKeyTile);
  }

  // Units in order of sequence, key head and query tile; when there are fewer than four per
  // thread, each unit's keys are split into chunks (at least four key tiles each) whose
  // candidates merge afterwards. Tasks are handed out most expensive first.
  void plan(int threads) {
    for (int32_t b = 0; b < static_cast<int32_t>(seqs_.size()); ++b) {
      const Sequence& seq = seqs_[b];
      for (int32_t g = 0; g < p_.heads_k; ++g) {
        for (int64_t p0 = 0; p0 < seq.q_len; p0 += positions_) {
          Unit u{b, g, p0, static_cast<int32_t>(std::min(positions_, seq.q_len - p0)), 0, 0, 1, 0};
          u.lo = seq.k_len;
          for (int r = 0; r < u.rows; ++r) {
            const KeyRange k = visible_keys(mask_, seq, p0 + r);
            if (k.end > k.begin) {
              u.lo = std::min(u.lo, k.begin);
              u.hi = std::max(u.hi, k.end);
            }
          }
          if (u.hi <= u.lo) u.lo = u.hi = 0;
          units_.push_back(u);
        }
      }
    }
    const int64_t target = int64_t{4} * threads;
    const int64_t n = static_cast<int64_t>(units_.size());
    int64_t slot_rows = 0;
    for (int32_t i = 0; i < n; ++i) {
      Unit& u = units_[i];
      const int64_t tiles = tile_count(u);
      if (n < target) {
        u.chunks = static_cast<int32_t>(
            std::clamp<int64_t>(std::min((target + n - 1) / n, tiles / 4), 1, 1024));
      }
      if (u.chunks > 1) {
        u.slot_base = slot_rows;
        slot_rows += static_cast<int64_t>(u.chunks) * u.rows;
        merges_.push_back(i);
      }
      for (int32_t c = 0; c < u.chunks; ++c) {
        tasks_.push_back({i, c, u.rows * (u.hi - u.lo) / u.chunks});
      }
    }
    std::stable_sort(tasks_.begin(), tasks_.end(),
                     [](const Task& a, const Task& b) { return a.cost > b.cost; });
    slots_.assign(static_cast<size_t>(slot_rows * k_), 0);
    slot_counts_.assign(slot_rows, 0);
  }

  // Offers the visible scores [lo, hi) of one tile row to row r's candidates. Keys arrive in
  // increasing position, so a score equal to the row's K-th best loses its tie: a plain float
  // comparison with that score (`limit`, NaN while everything is taken) rejects most keys before
  // their candidate word is formed, a vector of scores at a time (first_above).
  void absorb(Scratch& sc, int r, const float* s, int64_t j0, int64_t lo, int64_t hi) const {
    uint64_t* best = sc.best.data() + r * cap_;
    int64_t n = sc.count[r];
    uint64_t floor = sc.floor[r];
    float limit = sc.limit[r];
    for (int64_t c = lo; c < hi; ++c) {
      if (limit == limit) {  // a cut-off (not NaN): on to the first score through it
        c += set_.rows.first_above(s + c, hi - c, limit);
        if (c >= hi) break;
      }
      const uint64_t cand = candidate(s[c], j0 + c);
      if (cand <= floor) continue;
      best[n++] = cand;
      if (n == cap_) {
        floor = keep_best(best, n, k_, sc.sort.data());
        n = k_;
        limit = score_of(floor);
      }
    }
    sc.count[r] = n;
    sc.floor[r] = floor;
    sc.limit[r] = limit;
  }

  void write(const Unit& u, int r, const uint64_t* best, int64_t n) const {
    const Sequence& seq = seqs_[u.b];
    const int64_t token =
        p_.layout_query == Layout::kTND ? seq.q_begin + u.p0 + r : seq.batch * p_.seq_q + u.p0 + r;
    const int64_t out = (token * p_.heads_k + u.g) * k_;
    for (int64_t i = 0; i < n; ++i) p_.indices[out + i] = position_of(best[i]);
    if (p_.values != nullptr) {
      for (int64_t i = 0; i < n; ++i) p_.values[out + i] = p_.scale_value * score_of(best[i]);
    }
  }

  const LightningIndexerParams& p_;
  int64_t groups_;
  int64_t k_;
  int64_t cap_;  // candidates a row holds before it is cut back to k_
  const kernels::KernelSet& set_;
  indexer::Operands operands_;
  indexer::Packer packer_;
  Mask mask_;
  std::vector<Sequence> seqs_;
  int64_t positions_;  // query positions per unit
  int64_t rows_;       // positions_ padded to the set's row_align
  std::vector<Unit> units_;
  std::vector<Task> tasks_;
  std::vector<int32_t> merges_;  // units split into chunks
  std::vector<uint64_t> slots_;  // [slot row][k_] candidates of split units' chunks
  std::vector<int64_t> slot_counts_;
};

}  // namespace

std::vector<Sequence> lightning_indexer_sequences(const LightningIndexerParams& p) {
  std::vector<Sequence> seqs = query_key_sequences(p, p.layout_key);
  apply_residuals(p, seqs);
  return seqs;
}

void validate(const LightningIndexerParams& p) {
  validate(p, p.layout_key, "layout_key", "actual_seq_lengths_query", "actual_seq_lengths_key");
  if (p.sparse_count < 1 || p.sparse_count > kMaxSparseCount) {
    throw ArgumentError("sparse_count",
                        "must be in [1, " + str(kMaxSparseCount) + "], got " + str(p.sparse_count));
  }
  check_grouped_heads(p.heads_q, p.heads_k);
  validate(static_cast<const Compression&>(p), p.batch, p.pre_tokens, p.next_tokens);
  if (!(p.scale_value > 0.0f) || std::isinf(p.scale_value)) {
    throw ArgumentError("scale_value",
                        "must be finite and > 0, got " + std::to_string(p.scale_value));
  }
  if (p.head_dim < 1 || p.head_dim > attention::kMaxHeadDim) {
    throw ArgumentError("query", "head dim D must be in [1, " + str(attention::kMaxHeadDim) +
                                     "], got " + str(p.head_dim));
  }
  if (p.weights_dtype != p.qk_dtype && p.weights_dtype != DType::kFloat32) {
    throw ArgumentError("weights", std::string("dtype must be ") + dtype_name(p.qk_dtype) +
                                       " or float32, got " + dtype_name(p.weights_dtype));
  }
}

void lightning_indexer(const LightningIndexerParams& p, const Executor& executor, Isa isa) {
  validate(p);
  require_supported(isa);
  const int64_t rows = p.layout_query == Layout::kTND ? p.seq_q : p.batch * p.seq_q;
  const int64_t entries = rows * p.heads_k * p.sparse_count;
  // Entries no selection reaches (fewer visible keys than K, BSND rows past a length).
  std::fill(p.indices, p.indices + entries, -1);
  if (p.values != nullptr) {
    std::fill(p.values, p.values + entries, -std::numeric_limits<float>::infinity());
  }
  const int threads = std::max(1, executor.num_workers());
  TopKRun run(p, isa, threads);
  std::vector<std::unique_ptr<TopKRun::Scratch>> scratch(threads);
  const std::vector<Task>& tasks = run.tasks();
  run_dynamic(executor, static_cast<int64_t>(tasks.size()), [&](int64_t t, int thread) {
    if (!scratch[thread]) scratch[thread] = std::make_unique<TopKRun::Scratch>(run);
    const kernels::WorkerScope scope(run.kernel_set());
    run.run_task(*scratch[thread], tasks[t]);
  });
  const std::vector<int32_t>& merges = run.merges();
  run_dynamic(executor, static_cast<int64_t>(merges.size()), [&](int64_t m, int) {
    std::vector<uint64_t> buffer;
    run.merge(run.unit(merges[m]), buffer);
  });
}

}  // namespace opmesh::core
