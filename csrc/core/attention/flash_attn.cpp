#include "flash_attn.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../aligned_buffer.h"
#include "../errors.h"
#include "../kernel_choice.h"
#include "../kernels/kernel_set.h"
#include "../kernels/row_loads.h"
#include "../online_softmax.h"

namespace opmesh::core::attention {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kCacheLimitBytes = int64_t{64} << 20;
constexpr int64_t kSideBySideBytes = int64_t{2} << 20;
// Scratch kept between calls (ScratchPool): at most this many, each at most this large.
constexpr size_t kKeptScratches = 16;
constexpr size_t kKeptScratchBytes = size_t{1} << 20;

using kernels::KernelSet;
using kernels::LinesAhead;
using kernels::round_up;
using kernels::RowsAhead;

// Running state of a tile of rows: unnormalised output, row max, row sum.
struct State {
  float* o;
  float* m;
  float* l;
};

// Folds `src` into `dst`; the one merge used both inside a worker and by combine tasks, so a
// deterministic plan gives the same bits whichever worker computed which part.
void merge_into(const State& dst, const State& src, int64_t rows, int64_t ld, int64_t dv) {
  for (int64_t r = 0; r < rows; ++r) {
    const float m = nan_max(dst.m[r], src.m[r]);
    if (m == kNegInf) continue;
    const float a = dst.m[r] == kNegInf ? 0.0f : std::exp(dst.m[r] - m);
    const float b = src.m[r] == kNegInf ? 0.0f : std::exp(src.m[r] - m);
    float* d = dst.o + r * ld;
    const float* s = src.o + r * ld;
    for (int64_t e = 0; e < dv; ++e) d[e] = d[e] * a + s[e] * b;
    dst.l[r] = dst.l[r] * a + src.l[r] * b;
    dst.m[r] = m;
  }
}

// Decode (every sequence at most kDecodeRows query rows) is memory-bound, anything else
// compute-bound: the two kinds of work may prefer different bf16 kernels (kernel_choice.h).
const KernelSet& choose_set(const FlashAttnParams& p, const std::vector<Sequence>& seqs, Isa isa) {
  int64_t rows = 0;
  for (const Sequence& s : seqs) rows = std::max(rows, s.q_len);
  return kernels::select_set(isa, p.dtype, p.bf16_pairs, rows > kDecodeRows);
}

class Runner {
 public:
  Runner(const FlashAttnParams& p, const std::vector<Sequence>& seqs, const Plan& plan, Isa isa)
      : p_(p),
        seqs_(seqs),
        plan_(plan),
        walker_(p.config, seqs),
        g_(plan.geometry),
        k_(choose_set(p, seqs, isa)),
        pairs_(k_.word == kernels::Word::kBf16Pair),
        mods_(p.softcap > 0.0f || p.alibi_slopes != nullptr),
        raw_scores_(pairs_ && !mods_ && p.softmax_scale > 0.0f),
        score_alpha_(raw_scores_ ? 1.0f : p.softmax_scale),
        d_(p.config.head_dim),
        dv_(p.config.head_dim_v),
        words_(pairs_ ? (d_ + 1) / 2 : d_),
        dw_(round_up(words_, k_.depth_align)),
        rows_(largest_tile_rows(seqs, g_)),
        rows_cap_(round_up(rows_, k_.row_align)),
        elem_(p.dtype == DType::kFloat64   ? 8
              : p.dtype == DType::kFloat32 ? 4
                                           : 2),
        block_tiles_(std::max(k_.block_tiles, k_.decode_block_tiles)),
        quantized_(p.kv_format != CacheFormat::kPlain),
        kv_elem_(quantized_ ? 1 : elem_),
        ksd_(quantized_ ? 1 : p.k.sd),
        vsd_(quantized_ ? 1 : p.v.sd),
        stage_ld_((round_up(std::max(d_, dv_) * elem_, 64) + 64) / elem_),
        dvp_(round_up(dv_, 16)),
        vld_(dvp_ % 32 == 0 ? dvp_ + 16 : dvp_),
        k_tile_words_(dw_ * kKeyTile),
        v_tile_words_((pairs_ ? kKeyTile / 2 : kKeyTile) * vld_),
        slot_floats_(g_.rows * (dvp_ + 2)),
        direct_keys_(direct_keys(p, k_)),
        direct_values_(direct_keys_ && k_.value_rows != nullptr && vsd_ == 1 && dv_ % 32 == 0),
        widens_rows_(!pairs_ && p.dtype != DType::kFloat32 && ksd_ == 1 && vsd_ == 1) {
    // (Heads run side by side only on sequences of one query tile: decode_block_tiles.)
    const int64_t rows_bytes = k_.decode_block_tiles * kKeyTile * (d_ + dv_) * kv_elem_;
    const int64_t state_bytes =
        4 * (rows_cap_ * dw_ + 2 * rows_ * dvp_ + (direct_keys_ ? dw_ * kKeyTile : 0));
    side_heads_ = std::max<int64_t>(1, kSideBySideBytes / (rows_bytes + state_bytes));
  }

  int64_t slot_floats() const { return slot_floats_; }
  const KernelSet& kernel_set() const { return k_; }
  const UnitWalker& walker() const { return walker_; }

  // The packed query rows and the running states of one unit. A worker running the units of
  // several key heads side by side (run_side_by_side) holds one for each.
  struct UnitState {
    explicit UnitState(const Runner& r)
        : q(r.rows_cap_ * r.dw_),
          o(2 * r.rows_ * r.dvp_),
          stats(5 * r.rows_),
          qt(r.direct_keys_ ? r.dw_ * kKeyTile : 0) {}
    AlignedBuffer<uint32_t> q;
    AlignedBuffer<float> o;      // current state's output, then the running fold's
    AlignedBuffer<float> stats;  // m, l (current), m, l (running), correction
    AlignedBuffer<uint32_t> qt;  // direct keys: the query rows transposed, [dw][64] pair words
  };

  // What a Scratch's and its unit states' sizes depend on: one built for a runner of the same
  // shape serves another.
  struct ScratchShape {
    int64_t rows, rows_cap, dw, dvp, block_tiles, d, dv, positions, stage_ld, elem;
    bool direct_keys, quantized;
    bool operator==(const ScratchShape& o) const {
      return rows == o.rows && rows_cap == o.rows_cap && dw == o.dw && dvp == o.dvp &&
             block_tiles == o.block_tiles && d == o.d && dv == o.dv && positions == o.positions &&
             stage_ld == o.stage_ld && elem == o.elem && direct_keys == o.direct_keys &&
             quantized == o.quantized;
    }
  };
  ScratchShape scratch_shape() const {
    return {rows_, rows_cap_,    dw_,       dvp_,  block_tiles_, d_,
            dv_,   g_.positions, stage_ld_, elem_, direct_keys_, quantized_};
  }

  // Per physical thread: packed operands, tiles, states and the packed key/value cache.
  struct Scratch {
    explicit Scratch(const Runner& r)
        : shape(r.scratch_shape()),
          s(r.rows_cap_ * r.block_tiles_ * kKeyTile),
          pb(r.rows_cap_ * r.block_tiles_ * kKeyTile),
          row(std::max(r.d_, r.dv_) + 2),
          vis(r.g_.positions),
          st(r.direct_keys_ ? kKeyTile * 16 : 0),
          st_rows(r.direct_keys_ ? kKeyTile * 16 : 0),
          ahead_k(r.block_tiles_ * kKeyTile),
          ahead_v(r.block_tiles_ * kKeyTile) {
      if (r.quantized_) {
        for (int i = 0; i < 2; ++i) {
          stage[i] = AlignedBuffer<char>(r.block_tiles_ * kKeyTile * r.stage_ld_ * r.elem_);
          stage_tags[i].assign(r.block_tiles_, StageTag{});
          scales[i] = AlignedBuffer<float>(r.block_tiles_ * kKeyTile);
        }
      }
      use(r, 0);
    }
    // Ready for another call of the same shape: forgets which key/value tiles it holds packed
    // or staged (the cache's rows may have changed since) and the last call's group; the
    // buffers' contents are rewritten before they are read, as between units of one call.
    void renew(const Runner& r) {
      cache_b = cache_h = -1;
      cache_all = tiles_reused = false;
      stretch_end = 0;
      p0 = 0;
      group_h0 = 0;
      group_h1 = 1;
      ahead_end = 0;
      keys_ahead = values_ahead = {};
      for (auto& tags : stage_tags) tags.assign(tags.size(), StageTag{});
      use(r, 0);
    }
    // Bytes held, for ScratchPool's limit.
    size_t bytes() const {
      size_t n = s.size() * 4 + pb.size() * 2 + row.size() * 4 + st.size() * 4 +
                 st_rows.size() * 4 + kcache.size() * 4 + vcache.size() * 4 + packed.size() +
                 vis.size() * sizeof(KeyRange) +
                 (value_rows.size() + ahead_k.size() + ahead_v.size()) * sizeof(void*);
      for (int i = 0; i < 2; ++i) n += stage[i].size() + scales[i].size() * 4;
      for (const auto& unit : units) {
        n += (unit->q.size() + unit->qt.size()) * 4 + (unit->o.size() + unit->stats.size()) * 4;
      }
      return n;
    }
    const ScratchShape shape;
    AlignedBuffer<float> s;
    AlignedBuffer<uint16_t> pb;
    std::vector<const uint16_t*> value_rows;  // value_product: the block's value rows
    AlignedBuffer<float> row;
    std::vector<KeyRange> vis;
    AlignedBuffer<float> st;          // direct keys: one tile's S^T, [64 keys][16 rows]
    AlignedBuffer<uint32_t> st_rows;  // direct keys: S^T transposed, [16 rows][64 keys]
    int64_t p0 = 0;                   // the unit's first query position (for the ALiBi distances)
    std::vector<std::unique_ptr<UnitState>> units;
    UnitState* u = nullptr;  // the unit being run
    // Packed key/value tiles of one (sequence, key head), kept while a worker stays on it.
    int32_t cache_b = -1, cache_h = -1;
    bool cache_all = false;
    // Set by piece(): whether the worker's stretch holds a later query tile of the piece's
    // (sequence, key head), which would read the packed tiles again. Units past stretch_end (a
    // unit index) belong to other stretches.
    bool tiles_reused = false;
    int64_t stretch_end = 0;
    AlignedBuffer<uint32_t> kcache;  // packed key tiles, one after another
    AlignedBuffer<uint32_t> vcache;  // packed value tiles: those of a block are contiguous
    std::vector<uint8_t> packed;
    // Decode: the rows of the next block the running head asks for while it computes this one
    // (plan_ahead), among the key heads [group_h0, group_h1) that run side by side (one head in
    // a piece), whose key tiles end at ahead_end; the addresses of up to a block's rows.
    int32_t group_h0 = 0, group_h1 = 1;
    int64_t ahead_end = 0;
    std::vector<const char*> ahead_k, ahead_v;
    RowsAhead keys_ahead, values_ahead;
    // A quantized cache: the key (0) and value (1) rows of the block's tiles in q's dtype, tile j
    // in slot j % step_tiles(b) (stage_ld elements per row), which tile each slot holds, and the
    // block's row scales (keys past the sequence: 0).
    struct StageTag {
      int64_t b = -1, h = -1, j = -1;
    };
    AlignedBuffer<char> stage[2];
    std::vector<StageTag> stage_tags[2];
    AlignedBuffer<float> scales[2];
    // Makes unit state i (created on first use) the current one.
    void use(const Runner& r, size_t i) {
      while (units.size() <= i) units.push_back(std::make_unique<UnitState>(r));
      u = units[i].get();
    }
    State cur(const Runner& r) { return {u->o.data(), u->stats.data(), u->stats.data() + r.rows_}; }
    State run(const Runner& r) {
      return {u->o.data() + r.rows_ * r.dvp_, u->stats.data() + 2 * r.rows_,
              u->stats.data() + 3 * r.rows_};
    }
    float* correction(const Runner& r) { return u->stats.data() + 4 * r.rows_; }
  };

  void reset(const State& s, int64_t rows) const {
    std::fill(s.o, s.o + rows * dvp_, 0.0f);
    std::fill(s.m, s.m + rows, kNegInf);
    std::fill(s.l, s.l + rows, 0.0f);
  }

  State slot(float* ws, int64_t index) const {
    float* base = ws + index * slot_floats_;
    return {base, base + g_.rows * dvp_, base + g_.rows * dvp_ + g_.rows};
  }

  void store(const State& src, const State& dst, int64_t rows) const {
    std::copy(src.o, src.o + rows * dvp_, dst.o);
    std::copy(src.m, src.m + rows, dst.m);
    std::copy(src.l, src.l + rows, dst.l);
  }

  // One piece: key tiles [k_from, k_to) of unit (b, h, t).
  void piece(Scratch& sc, int32_t b, int32_t h, int32_t t, int32_t k_from, int32_t k_to,
             const TileSpan& sp, const WorkerRange& range, float* ws) const {
    const Sequence& seq = seqs_[b];
    const int64_t p0 = walker_.tile_begin(t);
    const int64_t p1 = walker_.tile_end(b, t);
    const int64_t rows = (p1 - p0) * g_.group;
    const bool first = k_from == sp.begin;
    const bool last = k_to == sp.end;
    const bool det = plan_.chunk_tiles > 0;
    sc.use(*this, 0);
    sc.group_h0 = h;
    sc.group_h1 = h + 1;
    sc.ahead_end = k_to;
    sc.tiles_reused = t + 1 < walker_.num_query_tiles(b) &&
                      walker_.unit_index(walker_.unit_start(b, h, t + 1)) < sc.stretch_end;
    const State cur = sc.cur(*this);
    const State run = sc.run(*this);
    reset(cur, rows);
    if (det) reset(run, rows);
    if (k_to > k_from) {
      pack_queries(sc, b, h, p0, p1);
      for (int64_t i = p0; i < p1; ++i) sc.vis[i - p0] = visible_keys(p_.config, seq, i);
      sc.p0 = p0;
    }
    int64_t next_slot = range.begin_slot;
    bool pending = false;
    auto flush = [&] {
      if (first) {
        fold_into_run(sc, rows);
      } else {
        store(cur, slot(ws, next_slot++), rows);
        reset(cur, rows);
      }
      pending = false;
    };
    // Blocks are aligned to absolute multiples of the sequence's block size (a divisor of the
    // deterministic chunk), so a unit is grouped the same way whichever pieces it is cut into.
    const int64_t step = step_tiles(b);
    for (int64_t j = k_from; j < k_to;) {
      if (det && pending && j % plan_.chunk_tiles == 0) flush();
      const int64_t j1 = std::min<int64_t>(k_to, (j / step + 1) * step);
      block(sc, b, h, j, j1, sp, rows);
      pending = true;
      j = j1;
    }
    if (det && pending) flush();
    const State& result = det ? run : cur;
    if (first && last) {
      finalize(result, b, h, p0, p1);
    } else if (first) {
      store(result, slot(ws, range.end_slot), rows);
    } else if (!det) {
      store(cur, slot(ws, range.begin_slot), rows);
    }
  }

  void combine(Scratch& sc, const CombineTask& ct, float* ws) const {
    const int64_t p0 = walker_.tile_begin(ct.t);
    const int64_t p1 = walker_.tile_end(ct.b, ct.t);
    const int64_t rows = (p1 - p0) * g_.group;
    sc.use(*this, 0);
    const State acc = sc.run(*this);
    reset(acc, rows);
    for (int32_t s = 0; s < ct.num_slots; ++s) {
      merge_into(acc, slot(ws, ct.first_slot + s), rows, dvp_, dv_);
    }
    finalize(acc, ct.b, ct.h, p0, p1);
  }

  // Whether piece [k_from, k_to) of unit (b, h, t) may run side by side with the same pieces of
  // the neighbouring key heads: a whole unit with keys, in a sequence of one query tile (whose
  // packed tiles no other query tile reuses).
  bool side_by_side(int64_t b, int64_t k_from, int64_t k_to, const TileSpan& sp) const {
    return p_.config.num_heads_kv > 1 && k_from == sp.begin && k_to == sp.end && k_to > k_from &&
           walker_.num_query_tiles(b) == 1;
  }

  // How many key heads run side by side at most: as many as keep one block's key and value rows
  // and the running states of all of them within kSideBySideBytes (about a core's L2 cache). More
  // heads would evict the rows before the last head reads them, and only add states to carry
  // (measured: 64 key heads side by side ran 7% slower than one at a time).
  int64_t side_by_side_heads() const { return side_heads_; }

  // Key tiles per online-softmax step of sequence b: the set's decode_block_tiles for a sequence
  // of one query tile whose key heads may run side by side (more than one key head), its
  // block_tiles otherwise. With one key head nothing runs side by side, and the longer steps
  // amortise each step's fixed costs (the rows' maximum and sum, the output's rescaling) as in
  // prefill (one token, 8/1 heads, on Zen 4, against one-tile steps in the same process:
  // 1.12-1.16x the rate with the bytes in cache, 1.0-1.11x from memory; 64/1 heads 1.09-1.10x).
  // The lengths and heads decide, not the plan: the same bits whichever way a plan cuts or
  // groups its units.
  int64_t step_tiles(int64_t b) const {
    return walker_.num_query_tiles(b) == 1 && p_.config.num_heads_kv > 1 ? k_.decode_block_tiles
                                                                         : k_.block_tiles;
  }

  // Whole units (b, h, t) of key heads [h0, h1), side by side: block by block, each head in turn.
  // In the interleaved layouts a key or value row holds the key heads next to each other, so the
  // heads together read whole rows of a block while they are in cache, where one head at a time
  // reads a narrow slice of every row of the sequence (decode, 32/8 heads, 8 x 8192 keys: 1.2x
  // faster). Each head takes the steps piece() takes, in the same order: the same bits.
  void run_side_by_side(Scratch& sc, int32_t b, int32_t h0, int32_t h1, int32_t t,
                        const TileSpan& sp) const {
    const int64_t p0 = walker_.tile_begin(t);
    const int64_t p1 = walker_.tile_end(b, t);
    const int64_t rows = (p1 - p0) * g_.group;
    const bool det = plan_.chunk_tiles > 0;
    const int64_t step = step_tiles(b);
    sc.tiles_reused = false;  // one query tile
    sc.group_h0 = h0;
    sc.group_h1 = h1;
    sc.ahead_end = sp.end;
    for (int32_t h = h0; h < h1; ++h) {
      sc.use(*this, h - h0);
      reset(sc.cur(*this), rows);
      if (det) reset(sc.run(*this), rows);
      pack_queries(sc, b, h, p0, p1);
    }
    for (int64_t i = p0; i < p1; ++i) sc.vis[i - p0] = visible_keys(p_.config, seqs_[b], i);
    sc.p0 = p0;
    bool pending = false;
    for (int64_t j = sp.begin; j < sp.end;) {
      const bool fold = det && pending && j % plan_.chunk_tiles == 0;
      const int64_t j1 = std::min<int64_t>(sp.end, (j / step + 1) * step);
      for (int32_t h = h0; h < h1; ++h) {
        sc.use(*this, h - h0);
        if (fold) fold_into_run(sc, rows);
        block(sc, b, h, j, j1, sp, rows);
      }
      pending = true;
      j = j1;
    }
    for (int32_t h = h0; h < h1; ++h) {
      sc.use(*this, h - h0);
      if (det) fold_into_run(sc, rows);
      finalize(det ? sc.run(*this) : sc.cur(*this), b, h, p0, p1);
    }
  }

 private:
  void fold_into_run(Scratch& sc, int64_t rows) const {
    merge_into(sc.run(*this), sc.cur(*this), rows, dvp_, dv_);
    reset(sc.cur(*this), rows);
  }

  int64_t key_offset(const View& view, int64_t b, int64_t h, int64_t key) const {
    if (p_.block_table != nullptr) {
      const int64_t block = p_.block_table[b * p_.bt_sb + (key / p_.block_size) * p_.bt_sj];
      return block * view.sb + (key % p_.block_size) * view.ss + h * view.sn;
    }
    return b * view.sb + (seqs_[b].k_begin + key) * view.ss + h * view.sn;
  }

  // Where rows [0, valid) of key tile j of (b, h) lie in memory (a quantized cache's bytes).
  void raw_tile_rows(const View& view, int64_t b, int64_t h, int64_t j, int64_t valid,
                     const char** rows) const {
    key_row_addresses(
        j * kKeyTile, valid, p_.block_table != nullptr ? p_.block_size : 0, view.ss * kv_elem_,
        [&](int64_t key) {
          return static_cast<const char*>(view.data) + key_offset(view, b, h, key) * kv_elem_;
        },
        rows);
  }

  // Where rows [0, valid) of key tile j of (b, h) of k or v (`view`) are read from, in q's dtype:
  // where they lie, or a quantized cache's rows dequantized (staged).
  void tile_rows(Scratch& sc, const View& view, int64_t b, int64_t h, int64_t j, int64_t valid,
                 const char** rows) const {
    if (!quantized_) {
      raw_tile_rows(view, b, h, j, valid, rows);
      return;
    }
    const char* base = staged(sc, &view == &p_.k ? 0 : 1, b, h, j);
    for (int64_t n = 0; n < valid; ++n) rows[n] = base + n * stage_ld_ * elem_;
  }

  // The rows of tile j of (b, h) of k (which 0) or v (1) of a quantized cache in q's dtype
  // (exact: the scales are applied to the scores and the probabilities, load_scales), converted
  // into the worker's slot j % step_tiles(b) when the slot does not hold them yet; rows past the
  // sequence's keys are zeros (read, then masked, by the in-place score products).
  const char* staged(Scratch& sc, int which, int64_t b, int64_t h, int64_t j) const {
    const int64_t slot = j % step_tiles(b);
    char* base = sc.stage[which].data() + slot * kKeyTile * stage_ld_ * elem_;
    Scratch::StageTag& tag = sc.stage_tags[which][slot];
    if (tag.b == b && tag.h == h && tag.j == j) return base;
    tag = {b, h, j};
    const View& view = which == 0 ? p_.k : p_.v;
    const int64_t dim = which == 0 ? d_ : dv_;
    const int64_t valid = std::clamp<int64_t>(seqs_[b].k_len - j * kKeyTile, 0, kKeyTile);
    const char* rows[kKeyTile];
    raw_tile_rows(view, b, h, j, valid, rows);
    for (int64_t n = 0; n < valid; ++n) {
      const auto* src = reinterpret_cast<const uint8_t*>(rows[n]);
      char* dst = base + n * stage_ld_ * elem_;
      if (p_.dtype == DType::kBFloat16) {
        k_.rows.widen_quantized_bf16(src, p_.kv_format, dim, reinterpret_cast<uint16_t*>(dst));
      } else if (p_.dtype == DType::kFloat32) {
        k_.rows.widen_quantized_f32(src, p_.kv_format, dim, reinterpret_cast<float*>(dst));
      } else {
        k_.rows.widen_quantized_f32(src, p_.kv_format, dim, sc.row.data());
        store_row(dst, p_.dtype, 0, 1, dim, sc.row.data(), 1.0f);
      }
    }
    std::memset(base + valid * stage_ld_ * elem_, 0,
                static_cast<size_t>((kKeyTile - valid) * stage_ld_ * elem_));
    return base;
  }

  // The row scales of key tiles [j0, j1) of (b, h), keys then values, into sc.scales (0 past the
  // sequence's keys).
  void load_scales(Scratch& sc, int64_t b, int64_t h, int64_t j0, int64_t j1) const {
    for (int which = 0; which < 2; ++which) {
      const View& view = which == 0 ? p_.k_scale : p_.v_scale;
      float* out = sc.scales[which].data();
      for (int64_t j = j0; j < j1; ++j, out += kKeyTile) {
        const int64_t valid = std::clamp<int64_t>(seqs_[b].k_len - j * kKeyTile, 0, kKeyTile);
        const char* rows[kKeyTile];
        key_row_addresses(
            j * kKeyTile, valid, p_.block_table != nullptr ? p_.block_size : 0,
            view.ss * static_cast<int64_t>(sizeof(float)),
            [&](int64_t key) {
              return reinterpret_cast<const char*>(static_cast<const float*>(view.data) +
                                                   key_offset(view, b, h, key));
            },
            rows);
        for (int64_t n = 0; n < valid; ++n) out[n] = *reinterpret_cast<const float*>(rows[n]);
        std::fill(out + valid, out + kKeyTile, 0.0f);
      }
    }
  }

  const char* at(const View& view, int64_t offset) const {
    return static_cast<const char*>(view.data) + offset * elem_;
  }

  void pack_queries(Scratch& sc, int64_t b, int64_t h, int64_t p0, int64_t p1) const {
    const View& q = p_.q;
    for (int64_t i = p0; i < p1; ++i) {
      for (int64_t g = 0; g < g_.group; ++g) {
        const int64_t head = h * g_.group + g;
        const int64_t off = b * q.sb + (seqs_[b].q_begin + i) * q.ss + head * q.sn;
        uint32_t* dst = sc.u->q.data() + ((i - p0) * g_.group + g) * dw_;
        if (pairs_) {
          load_row_bf16_pairs(q.data, off, q.sd, d_, dst);
        } else if (q.sd == 1) {
          k_.widen(at(q, off), p_.dtype, d_, reinterpret_cast<float*>(dst));
        } else {
          load_row(q.data, p_.dtype, off, q.sd, d_, reinterpret_cast<float*>(dst));
        }
        std::fill(dst + words_, dst + dw_, 0u);
      }
    }
    if (!decode_rows(b) || row_scores(b)) return;  // the transposed rows are the GEMM's
    const int64_t rows = (p1 - p0) * g_.group;
    const char* qrows[kKeyTile];
    for (int64_t r = 0; r < rows; ++r) {
      qrows[r] = reinterpret_cast<const char*>(sc.u->q.data() + r * dw_);
    }
    k_.pack_keys(qrows, rows, dw_, sc.u->qt.data());
  }

  // Packs key tile j of (b, h) as [depth][64] words (transposed) and value tile j as
  // [keys or key pairs][dvp] words, zero beyond the sequence and the head dims. Contiguous rows
  // of float32 or bf16 take a direct path; anything else is converted element by element.
  void pack_tile(Scratch& sc, int64_t b, int64_t h, int64_t j, uint32_t* kp, uint32_t* vp) const {
    const int64_t valid = std::clamp<int64_t>(seqs_[b].k_len - j * kKeyTile, 0, kKeyTile);
    const bool keys = !reads_keys_in_place(b, j);
    const bool fast_k = ksd_ == 1 && (pairs_ ? d_ % 2 == 0 : p_.dtype == DType::kFloat32);
    const bool fast_v = vsd_ == 1 && (pairs_ || p_.dtype == DType::kFloat32);
    // Contiguous rows of another type for the float32 kernels: converted as they are packed.
    const bool stage_k = !fast_k && !pairs_ && ksd_ == 1;
    const bool stage_v = !fast_v && !pairs_ && vsd_ == 1;
    if (keys && !fast_k && !stage_k) std::fill(kp, kp + k_tile_words_, 0u);
    if (valid < kKeyTile || !(fast_v || stage_v) || dvp_ != dv_) {
      std::fill(vp, vp + v_tile_words_, 0u);
    }
    const char* krows[kKeyTile];
    const char* vrows[kKeyTile];
    if (keys) tile_rows(sc, p_.k, b, h, j, valid, krows);
    tile_rows(sc, p_.v, b, h, j, valid, vrows);
    if (!keys) {
      // Read in place by the score product.
    } else if (stage_k) {
      // Converted and transposed in one pass; the next tile's key rows are asked for from memory
      // meanwhile.
      k_.pack_widened_keys(krows, valid, p_.dtype, d_, sc.keys_ahead, kp);
      sc.keys_ahead = {};
      std::fill(kp + words_ * kKeyTile, kp + dw_ * kKeyTile, 0u);
    } else if (fast_k) {
      k_.pack_keys(krows, valid, words_, kp);
      std::fill(kp + words_ * kKeyTile, kp + dw_ * kKeyTile, 0u);
    } else {
      uint32_t* row = reinterpret_cast<uint32_t*>(sc.row.data());
      for (int64_t n = 0; n < valid; ++n) {
        // (Staged rows of a quantized cache: contiguous, at krows[n].)
        const void* base = quantized_ ? krows[n] : p_.k.data;
        const int64_t ko = quantized_ ? 0 : key_offset(p_.k, b, h, j * kKeyTile + n);
        if (pairs_) {
          load_row_bf16_pairs(base, ko, ksd_, d_, row);
        } else {
          load_row(base, p_.dtype, ko, ksd_, d_, sc.row.data());
        }
        for (int64_t d = 0; d < words_; ++d) kp[d * kKeyTile + n] = row[d];
      }
    }
    if (fast_v && pairs_) {
      // Rows 2i and 2i + 1 interleaved element by element into bf16 pairs. The next tile's value
      // rows are asked for in between, and its key rows too unless the score kernel asks for them.
      const int64_t steps = (valid + 1) / 2;
      LinesAhead ahead(sc.values_ahead, steps);
      LinesAhead keys_ahead(row_scores(b) ? RowsAhead{} : sc.keys_ahead, steps);
      sc.values_ahead = {};
      if (!row_scores(b)) sc.keys_ahead = {};
      for (int64_t i = 0; 2 * i < valid; ++i) {
        ahead.next();
        keys_ahead.next();
        const uint16_t* r0 = reinterpret_cast<const uint16_t*>(vrows[2 * i]);
        const uint16_t* r1 =
            2 * i + 1 < valid ? reinterpret_cast<const uint16_t*>(vrows[2 * i + 1]) : nullptr;
        k_.rows.interleave_bf16(r0, r1, dv_, vp + i * vld_);
      }
    } else if (fast_v) {
      for (int64_t n = 0; n < valid; ++n) std::memcpy(vp + n * vld_, vrows[n], dv_ * sizeof(float));
    } else if (stage_v) {
      LinesAhead ahead(sc.values_ahead, valid);
      sc.values_ahead = {};
      for (int64_t n = 0; n < valid; ++n) {
        ahead.next();
        k_.widen(vrows[n], p_.dtype, dv_, reinterpret_cast<float*>(vp) + n * vld_);
      }
    } else {
      uint16_t* vp16 = reinterpret_cast<uint16_t*>(vp);
      for (int64_t n = 0; n < valid; ++n) {
        const void* base = quantized_ ? vrows[n] : p_.v.data;
        const int64_t vo = quantized_ ? 0 : key_offset(p_.v, b, h, j * kKeyTile + n);
        if (pairs_) {
          const uint16_t* src = static_cast<const uint16_t*>(base) + vo;
          for (int64_t e = 0; e < dv_; ++e) {
            vp16[((n / 2) * vld_ + e) * 2 + (n & 1)] = src[e * vsd_];
          }
        } else {
          load_row(base, p_.dtype, vo, vsd_, dv_, reinterpret_cast<float*>(vp) + n * vld_);
        }
      }
    }
  }

  // The rows of the next block that head h asks for from memory while it computes this one,
  // tile by tile: while it computes tile i of the block, the rows of tile i of the next one. In
  // decode (row_scores) a tile's score product asks for its keys, and the values of the whole
  // next block are asked for during the block's value product (or its value packing, tile by
  // tile, where the values are packed); where the keys are packed, both between the value
  // packing's rows, for tiles that no later query tile reads again (S_q = 16 and 64/1 heads: the
  // rows come from memory once). Heads whose slices lie side by side in a row (the
  // interleaved layouts) split the rows between them, each asking for whole rows of all
  // the group's heads: memory then serves every row once and in order, where the hardware
  // prefetchers keep up. Otherwise each head asks for its own slice of every row.
  // Measured on an AMD EPYC (Zen 4), 8 x 8192 keys from memory: 32/8 heads, one token,
  // 17.5-20.1 -> 13.2-14.2 ms; S_q = 16, 82-84 -> 72 ms; 64/1 heads, one token, 10.6 -> 9.2 ms
  // (docs/ops/flash_attn.md).
  // The key (and, with `values`, value) rows of tiles [j0, j1) of the next block.
  void plan_ahead(Scratch& sc, int64_t b, int64_t h, int64_t j0, int64_t j1, bool values) const {
    sc.keys_ahead = share_ahead(sc, p_.k, d_, b, h, j0, j1, sc.ahead_k.data());
    if (values) sc.values_ahead = share_ahead(sc, p_.v, dv_, b, h, j0, j1, sc.ahead_v.data());
  }

  // The rows of tiles [j0, j1) (up to ahead_end) that head h asks for, their addresses in rows.
  RowsAhead share_ahead(const Scratch& sc, const View& view, int64_t dim, int64_t b, int64_t h,
                        int64_t j0, int64_t j1, const char** rows) const {
    const int64_t heads = sc.group_h1 - sc.group_h0;
    const bool split = heads > 1 && view.sn == dim;
    int64_t count = 0;
    for (int64_t j = j0; j < std::min(j1, sc.ahead_end); ++j) {
      const int64_t valid = std::clamp<int64_t>(seqs_[b].k_len - j * kKeyTile, 0, kKeyTile);
      raw_tile_rows(view, b, split ? sc.group_h0 : h, j, valid, rows + count);
      count += valid;
    }
    if (!split) return {rows, count, dim * kv_elem_};
    const int64_t i = h - sc.group_h0;
    const int64_t r0 = i * count / heads;
    const int64_t r1 = (i + 1) * count / heads;
    return {rows + r0, r1 - r0, ((heads - 1) * view.sn + dim) * kv_elem_};
  }

  // Packs key and value tiles j of (b, h) unless the worker's cache holds them; returns their
  // slot. With the whole (b, h) cached the slot is j; otherwise slots are reused per block, j
  // modulo the block size, so the value tiles of a block stay contiguous.
  int64_t ensure_tile(Scratch& sc, int32_t b, int32_t h, int64_t j) const {
    if (sc.cache_b != b || sc.cache_h != h) {
      const int64_t n = (seqs_[b].k_len + kKeyTile - 1) / kKeyTile;
      sc.cache_b = b;
      sc.cache_h = h;
      // Worth keeping only when another query tile of this (b, h) will reuse the tiles; otherwise
      // a long sequence's packed tiles would only be written out of cache.
      sc.cache_all = sc.tiles_reused && n * (k_tile_words_ + v_tile_words_) * 4 <= kCacheLimitBytes;
      // (A short sequence needs fewer slots than a block: a small call's buffers stay small.)
      const int64_t slots = sc.cache_all ? n : std::min(block_tiles_, n);
      // pack_tile writes every word the products read.
      sc.kcache.grow_uninitialized(slots * k_tile_words_);
      sc.vcache.grow_uninitialized(slots * v_tile_words_);
      sc.packed.assign(slots, 0);
    }
    const int64_t index = sc.cache_all ? j : j % step_tiles(b);
    if (!sc.cache_all || !sc.packed[index]) {
      pack_tile(sc, b, h, j, sc.kcache.data() + index * k_tile_words_,
                sc.vcache.data() + index * v_tile_words_);
      sc.packed[index] = 1;
    }
    return index;
  }

  // One online-softmax step over key tiles [j0, j1) of one block (at most block_tiles_): their
  // scores side by side, one softmax over all of them, one P.V product with the rescaling of the
  // output folded in.
  void block(Scratch& sc, int32_t b, int32_t h, int64_t j0, int64_t j1, const TileSpan& sp,
             int64_t rows) const {
    const int64_t tiles = j1 - j0;
    const int64_t cols = tiles * kKeyTile;
    const int64_t step = step_tiles(b);
    float* s = sc.s.data();
    sc.keys_ahead = sc.values_ahead = {};
    const bool ahead = row_scores(b) || ((pairs_ || widens_rows_) && !sc.tiles_reused);
    const bool values_in_place = reads_values_in_place(b, j0, j1);
    if (quantized_) load_scales(sc, b, h, j0, j1);
    int64_t first_slot = 0;
    for (int64_t i = 0; i < tiles; ++i) {
      const int64_t j = j0 + i;
      // Tile i of the next block; the last tile of a short block (a unit's first) the rest.
      const int64_t next = j1 + i;
      if (ahead) {
        plan_ahead(sc, b, h, next, i + 1 < tiles ? next + 1 : j1 + step, !values_in_place);
      }
      // (With the keys and the values read in place there is nothing to pack.)
      const int64_t slot = values_in_place ? 0 : ensure_tile(sc, b, h, j);
      if (i == 0) first_slot = slot;
      float* si = s + i * kKeyTile;
      if (reads_keys_in_place(b, j)) {
        in_place_scores(sc, b, h, j, si, cols, rows);
      } else {
        k_.gemm({sc.u->q.data(), dw_, sc.kcache.data() + slot * k_tile_words_, kKeyTile, si, cols,
                 rows, kKeyTile, dw_, nullptr, score_alpha_});
      }
      if (quantized_) {
        // The key rows' scales, before anything that is not linear in the score.
        for (int64_t r = 0; r < rows; ++r) {
          k_.rows.multiply_into(si + r * cols, sc.scales[0].data() + i * kKeyTile);
        }
      }
      if (mods_) modify_tile(sc, si, cols, b, h, j, rows);
      if (j < sp.full_begin || j >= sp.full_end) mask_tile(sc, si, cols, j, rows);
    }
    const uint32_t* vp = sc.vcache.data() + first_slot * v_tile_words_;
    const State cur = sc.cur(*this);
    float* corr = sc.correction(*this);
    if (ahead && values_in_place) {
      sc.values_ahead = share_ahead(sc, p_.v, dv_, b, h, j1, j1 + step, sc.ahead_v.data());
    }
    if (pairs_) {
      k_.softmax_bf16(s, rows, cols, raw_scores_ ? p_.softmax_scale : 1.0f, cur.m, cur.l, corr,
                      sc.pb.data());
      if (quantized_) {  // the value rows' scales on the probabilities (l is taken without them)
        for (int64_t r = 0; r < rows; ++r) {
          k_.rows.scale_bf16(sc.pb.data() + r * cols, sc.scales[1].data(), cols);
        }
      }
      if (values_in_place) {
        value_product(sc, b, h, j0, j1, rows, reinterpret_cast<const uint32_t*>(sc.pb.data()),
                      cols / 2, cur.o, corr);
      } else {
        k_.gemm({sc.pb.data(), cols / 2, vp, vld_, cur.o, dvp_, rows, dvp_, cols / 2, corr, 1.0f});
      }
    } else {
      k_.softmax(s, rows, cols, cur.m, cur.l, corr);
      for (int64_t r = 0; quantized_ && r < rows; ++r) {
        for (int64_t i = 0; i < tiles; ++i) {
          k_.rows.multiply_into(s + r * cols + i * kKeyTile, sc.scales[1].data() + i * kKeyTile);
        }
      }
      if (values_in_place) {
        value_product(sc, b, h, j0, j1, rows, reinterpret_cast<const uint32_t*>(s), cols, cur.o,
                      corr);
      } else {
        k_.gemm({s, cols, vp, vld_, cur.o, dvp_, rows, dvp_, cols, corr, 1.0f});
      }
    }
  }

  // o = corr o + P V over key tiles [j0, j1) of (b, h) from the value rows where they lie (rows
  // past the sequence's keys read as zeros, as the packed tiles hold them), P [rows][ldp] words
  // (bf16 pairs on a pair set, float32 else); the next block's value rows are asked for from
  // memory meanwhile.
  void value_product(Scratch& sc, int64_t b, int64_t h, int64_t j0, int64_t j1, int64_t rows,
                     const uint32_t* p, int64_t ldp, float* o, const float* corr) const {
    const int64_t cols = (j1 - j0) * kKeyTile;
    sc.value_rows.assign(cols, nullptr);
    const char* lines[kKeyTile];
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t valid = std::clamp<int64_t>(seqs_[b].k_len - j * kKeyTile, 0, kKeyTile);
      tile_rows(sc, p_.v, b, h, j, valid, lines);
      for (int64_t n = 0; n < valid; ++n) {
        sc.value_rows[(j - j0) * kKeyTile + n] = reinterpret_cast<const uint16_t*>(lines[n]);
      }
    }
    k_.value_rows({p, ldp, sc.value_rows.data(), cols, dv_, o, dvp_, corr, rows, sc.values_ahead});
    sc.values_ahead = {};
  }

  // The scores of key tile j of (b, h) from the key rows where they lie (rows with stride ld in
  // s): the set's row-by-row dot products for a few rows, else S^T = K Q^T into sc.st ([64][16])
  // transposed into s. The choice depends on the sequence's rows only, so a unit's bits do not
  // depend on the plan. Rows past the sequence's keys (inside a paged block) are read and then
  // masked like any key the row does not see.
  void in_place_scores(Scratch& sc, int64_t b, int64_t h, int64_t j, float* s, int64_t ld,
                       int64_t rows) const {
    const uint32_t* keys = reinterpret_cast<const uint32_t*>(
        quantized_
            ? staged(sc, 0, b, h, j)
            : static_cast<const char*>(p_.k.data) + key_offset(p_.k, b, h, j * kKeyTile) * elem_);
    const int64_t ldk = (quantized_ ? stage_ld_ : p_.k.ss) / 2;
    if (row_scores(b)) {
      // The keys' pair words per row: the query's words on pairs, half its float32 elements else.
      const int64_t depth = pairs_ ? dw_ : d_ / 2;
      k_.key_scores(
          {sc.u->q.data(), dw_, keys, ldk, s, ld, rows, depth, score_alpha_, sc.keys_ahead});
      sc.keys_ahead = {};
      return;
    }
    float* st = sc.st.data();
    k_.gemm(
        {keys, ldk, sc.u->qt.data(), kKeyTile, st, 16, kKeyTile, 16, dw_, nullptr, score_alpha_});
    // The transpose of S^T's rows (16 words each, `rows` of them used) is the set's key packing.
    const char* lines[kKeyTile];
    for (int64_t c = 0; c < kKeyTile; ++c) lines[c] = reinterpret_cast<const char*>(st + c * 16);
    uint32_t* packed = sc.st_rows.data();
    k_.pack_keys(lines, kKeyTile, rows, packed);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(s + r * ld, packed + r * kKeyTile, sizeof(float) * kKeyTile);
  }

  // softcap and ALiBi on the scores of key tile j (rows with stride ld: position, then head of
  // key head h's group).
  void modify_tile(Scratch& sc, float* s, int64_t ld, int64_t b, int64_t h, int64_t j,
                   int64_t rows) const {
    const Sequence& seq = seqs_[b];
    for (int64_t i = 0; i < rows / g_.group; ++i) {
      const int64_t dist0 = sc.p0 + i + seq.diag() - j * kKeyTile;
      for (int64_t g = 0; g < g_.group; ++g) {
        const int64_t head = h * g_.group + g;
        const float slope =
            p_.alibi_slopes != nullptr ? p_.alibi_slopes[seq.batch * p_.alibi_sb + head] : 0.0f;
        k_.rows.score_mods(s + (i * g_.group + g) * ld, p_.softcap, slope, dist0, -1, nullptr);
      }
    }
  }

  // Sets the scores of key tile j (columns [0, kKeyTile) of rows with stride ld) that their row
  // may not see to -inf.
  void mask_tile(Scratch& sc, float* s, int64_t ld, int64_t j, int64_t rows) const {
    const int64_t first_key = j * kKeyTile;
    for (int64_t i = 0; i < rows / g_.group; ++i) {
      const KeyRange vr = sc.vis[i];
      const int64_t lo = std::clamp<int64_t>(vr.begin - first_key, 0, kKeyTile);
      const int64_t hi =
          vr.end > vr.begin ? std::clamp<int64_t>(vr.end - first_key, 0, kKeyTile) : 0;
      // Columns [0, lo) and [hi, 64): everything when hi <= lo.
      for (int64_t g = 0; g < g_.group; ++g) {
        float* x = s + (i * g_.group + g) * ld;
        std::fill(x, x + lo, kNegInf);
        std::fill(x + hi, x + kKeyTile, kNegInf);
      }
    }
  }

  void finalize(const State& st, int64_t b, int64_t h, int64_t p0, int64_t p1) const {
    const Sequence& seq = seqs_[b];
    for (int64_t i = p0; i < p1; ++i) {
      for (int64_t g = 0; g < g_.group; ++g) {
        const int64_t r = (i - p0) * g_.group + g;
        const int64_t head = h * g_.group + g;
        const float m = st.m[r];
        const float l = st.l[r];
        float scale;
        float lse;
        if (p_.sinks != nullptr && p_.sinks[head] == std::numeric_limits<float>::infinity()) {
          // An infinite sink takes all the probability mass: nothing reaches the output.
          scale = 0.0f;
          lse = std::numeric_limits<float>::infinity();
        } else if (p_.sinks != nullptr) {
          const float sink = p_.sinks[head];
          const float top = nan_max(m, sink);
          const float carried = l == 0.0f ? 0.0f : std::exp(m - top);
          const float total = l * carried + std::exp(sink - top);
          scale = carried / total;
          lse = top + std::log(total);
        } else if (l == 0.0f) {
          scale = 0.0f;
          lse = std::numeric_limits<float>::infinity();
        } else {
          scale = 1.0f / l;
          lse = m + std::log(l);
        }
        const int64_t pos = seq.q_begin + i;
        if (p_.lse != nullptr) p_.lse[b * p_.lse_sb + head * p_.lse_sn + pos * p_.lse_ss] = lse;
        store_row(k_, p_.out.data, p_.dtype, b * p_.out.sb + pos * p_.out.ss + head * p_.out.sn,
                  p_.out.sd, dv_, st.o + r * dvp_, scale);
      }
    }
  }

  const FlashAttnParams& p_;
  const std::vector<Sequence>& seqs_;
  const Plan& plan_;
  UnitWalker walker_;
  Geometry g_;
  const KernelSet& k_;
  bool pairs_;
  bool mods_;  // softcap or ALiBi
  // bf16 pairs without score modifiers and with a positive scale: the score product leaves its
  // tiles unscaled (the AMX tiles store straight into the scores) and the softmax folds the
  // scale into its exp; otherwise the product applies score_alpha_ = the scale.
  bool raw_scores_;
  float score_alpha_;
  int64_t d_, dv_;
  int64_t words_;  // packed words per q/k row
  int64_t dw_;     // words_ padded to the set's depth_align (zero words)
  // Rows of the call's largest query tile: the plan's tile rows, or fewer where every sequence
  // has fewer query positions (decode), so that a small call's scratch stays small.
  int64_t rows_;
  int64_t rows_cap_;     // rows_ padded to the set's row_align
  int64_t elem_;         // bytes per input element
  int64_t block_tiles_;  // the most key tiles of an online-softmax step (step_tiles)
  // A quantized cache (kv_format): k and v are bytes, read through staged(); kv_elem_ is the
  // bytes of a k or v element in memory, ksd_ and vsd_ the strides along the head dims of the
  // rows the kernels read (staged rows: 1), stage_ld_ the staged rows' stride in elements (64
  // bytes past a whole number of cache lines, so that a tile's rows spread over the L1's sets).
  bool quantized_;
  int64_t kv_elem_;
  int64_t ksd_, vsd_;
  int64_t stage_ld_;
  int64_t dvp_;
  // Packed value rows' stride: dvp_, or 16 words more where dvp_ is a multiple of 32 words, so
  // that the rows of a column tile (a power-of-two stride apart otherwise) spread over the L1
  // cache's sets instead of evicting each other within a few.
  int64_t vld_;
  int64_t k_tile_words_, v_tile_words_;
  int64_t slot_floats_;
  // bf16 keys, each row a whole number of depth tiles of pairs: for sequences of at most 16 query
  // rows (decode), the score product reads the key rows where they lie, as the A operand (S^T = K
  // Q^T), instead of packing each key tile first; only the values are packed (unless
  // direct_values_).
  bool direct_keys_;
  // bf16 values of unit stride, whole 32-column blocks, on a set with value_rows: where decode
  // reads its keys in place through key_scores, its P.V reads the value rows in place too
  // (reads_values_in_place), instead of packing them first.
  bool direct_values_;
  // The float32 kernels on contiguous rows of a narrower type: pack_tile converts the rows as it
  // packs them, asking for the next block's rows from memory meanwhile.
  bool widens_rows_;
  int64_t side_heads_ = 1;  // side_by_side_heads()

  static int64_t largest_tile_rows(const std::vector<Sequence>& seqs, const Geometry& g) {
    int64_t positions = 0;
    for (const Sequence& s : seqs) positions = std::max(positions, std::min(s.q_len, g.positions));
    return std::max<int64_t>(1, positions) * g.group;
  }

  static bool direct_keys(const FlashAttnParams& p, const KernelSet& k) {
    const bool in_place_set =
        k.word == kernels::Word::kBf16Pair || (k.key_scores != nullptr && k.key_scores_rows >= 16);
    if (p.kv_format != CacheFormat::kPlain) {
      // Staged rows: whole tiles, aligned, of unit stride.
      return in_place_set && p.dtype == DType::kBFloat16 &&
             p.config.head_dim % (2 * k.depth_align) == 0;
    }
    const bool paged = p.block_table != nullptr;
    // Whole 4-byte pair words: an aligned base and even element strides.
    const bool words = reinterpret_cast<uintptr_t>(p.k.data) % 4 == 0 && p.k.ss % 2 == 0 &&
                       p.k.sn % 2 == 0 && p.k.sb % 2 == 0;
    // Any row stride: with several key heads interleaved, a tile of one head's rows is 256-byte
    // pieces far apart, but the heads of a query tile run side by side (run_side_by_side), and
    // their tiles together read whole rows; reading them in place beats packing them (measured on
    // decode, 32/8 heads). One rule for every stride keeps a unit's bits the same whatever the
    // layout and the plan.
    // A float32 set reads them in place only through key_scores, which then takes every decode
    // (key_scores_rows >= 16), and widens them in registers.
    const bool in_place =
        k.word == kernels::Word::kBf16Pair || (k.key_scores != nullptr && k.key_scores_rows >= 16);
    return in_place && p.dtype == DType::kBFloat16 &&
           p.config.head_dim % (2 * k.depth_align) == 0 && p.k.sd == 1 && words &&
           (!paged || p.block_size % kKeyTile == 0);
  }

  // Whether sequence b's query rows (all its positions times the group) fit one 16-row tile.
  bool decode_rows(int64_t b) const { return direct_keys_ && seqs_[b].q_len * g_.group <= 16; }

  // Whether sequence b's in-place scores are the set's row-by-row dot products (key_scores).
  bool row_scores(int64_t b) const {
    return decode_rows(b) && k_.key_scores != nullptr &&
           seqs_[b].q_len * g_.group <= k_.key_scores_rows;
  }

  // Whether the P.V of key tiles [j0, j1) of sequence b reads the value rows in place
  // (value_rows): a decode sequence of at most value_rows_rows rows whose block's scores come
  // from key_scores on keys in place. The same bits as the packed path, so the choice may differ
  // between blocks.
  bool reads_values_in_place(int64_t b, int64_t j0, int64_t j1) const {
    if (!direct_values_ || !row_scores(b)) return false;
    if (seqs_[b].q_len * g_.group > k_.value_rows_rows) return false;
    for (int64_t j = j0; j < j1; ++j) {
      if (!reads_keys_in_place(b, j)) return false;
    }
    return true;
  }

  // Whether key tile j of sequence b is read in place: a decode sequence whose tile has all its
  // 64 rows in memory with one stride (a paged block holds whole tiles; unpaged, the tile lies
  // inside the sequence).
  bool reads_keys_in_place(int64_t b, int64_t j) const {
    return decode_rows(b) &&
           (p_.block_table != nullptr || quantized_ || (j + 1) * kKeyTile <= seqs_[b].k_len);
  }
};

}  // namespace

void check_softcap(float softcap) {
  if (!(softcap >= 0.0f) || std::isinf(softcap)) {
    throw ArgumentError("softcap",
                        "must be finite and >= 0 (0: no capping), got " + std::to_string(softcap));
  }
}

void validate_score_mods(const PlanConfig& c, float softcap, const float* alibi_slopes,
                         int64_t alibi_sb) {
  check_softcap(softcap);
  if (alibi_slopes == nullptr) return;
  const int64_t rows = alibi_sb == 0 ? 1 : c.batch_size;
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t h = 0; h < c.num_heads_q; ++h) {
      if (!std::isfinite(alibi_slopes[b * alibi_sb + h])) {
        throw ArgumentError("alibi_slopes", "entry (" + std::to_string(b) + ", " +
                                                std::to_string(h) + ") is not finite");
      }
    }
  }
}

int64_t workspace_floats(const PlanConfig& config, const Plan& plan) {
  const int64_t dvp = round_up(config.head_dim_v, 16);
  return plan.num_slots * plan.geometry.rows * (dvp + 2);
}

void validate(const FlashAttnParams& p, const std::vector<Sequence>& seqs, const Plan& plan,
              Isa isa, const float* workspace) {
  validate_config(p.config);
  const PlanConfig& c = p.config;
  if (static_cast<int64_t>(seqs.size()) != c.batch_size) {
    throw ArgumentError("sequences", "expected " + std::to_string(c.batch_size) +
                                         " (batch_size), got " + std::to_string(seqs.size()));
  }
  for (size_t b = 0; b < seqs.size(); ++b) {
    const Sequence& s = seqs[b];
    if (s.q_len < 0 || s.q_len > c.max_seqlen_q || s.k_len < 0 || s.k_len > c.max_seqlen_kv ||
        s.q_begin < 0 || s.k_begin < 0) {
      throw ArgumentError(
          "sequences", "entry " + std::to_string(b) + " lies outside max_seqlen_q/max_seqlen_kv");
    }
  }
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16 &&
      p.dtype != DType::kFloat64) {
    throw ArgumentError("dtype", "expected float32, bfloat16, float16 or float64");
  }
  // An empty tensor may have no buffer: a pointer is required only where the kernel reads or
  // writes through it (queries and output rows when any sequence has queries, keys and values
  // when any sequence has both queries and keys).
  const SequenceWork work = sequence_work(seqs);
  if (work.queries) {
    if (p.q.data == nullptr) throw ArgumentError("q", "is null");
    if (p.out.data == nullptr) throw ArgumentError("out", "is null");
  }
  if (work.pairs) {
    if (p.k.data == nullptr) throw ArgumentError("k", "is null");
    if (p.v.data == nullptr) throw ArgumentError("v", "is null");
  }
  if (p.kv_format != CacheFormat::kPlain) {
    if (p.kv_format != CacheFormat::kInt8 && p.kv_format != CacheFormat::kFp8E4M3) {
      throw ArgumentError("kv_format", "is not a cache format");
    }
    if (work.pairs && p.k_scale.data == nullptr) throw ArgumentError("k_scale", "is null");
    if (work.pairs && p.v_scale.data == nullptr) throw ArgumentError("v_scale", "is null");
    if (p.k.sd != 1) throw ArgumentError("k", "a quantized cache needs unit stride along D");
    if (p.v.sd != 1) throw ArgumentError("v", "a quantized cache needs unit stride along Dv");
  }
  if (c.layout_kv == Layout::kPagedBBND) {
    if (p.block_table == nullptr && c.batch_size > 0) {
      throw ArgumentError("block_table", "is required with the paged layout PA_BBND");
    }
    if (p.block_size < 1) throw ArgumentError("block_size", "must be >= 1");
  }
  if (!std::isfinite(p.softmax_scale)) {
    throw ArgumentError("softmax_scale", "must be finite");
  }
  validate_score_mods(c, p.softcap, p.alibi_slopes, p.alibi_sb);
  if (static_cast<int64_t>(plan.workers.size()) != c.num_workers) {
    throw ArgumentError("plan", "has " + std::to_string(plan.workers.size()) +
                                    " worker stretches, the configuration " +
                                    std::to_string(c.num_workers));
  }
  if (plan.num_slots > 0 && workspace == nullptr) {
    throw ArgumentError("workspace", "is null but the plan has split units");
  }
  require_supported(isa);
}

// Scratch kept between calls. Building one takes a dozen aligned allocations, zero-filled, the
// larger ones mapped afresh by malloc: for a short decode that cost as much as the kernel (on a
// Zen 4, one token over 64 keys with 32/8 heads: 25.6 us a call at best with new scratch, 20.7
// us with scratch kept; docs/architecture.md). Calls of one shape, the steady state of decoding,
// take the scratch the last call gave back. Small ones only (kKeptScratchBytes), so that a long
// prefill's key/value cache does not stay allocated; a mutex, as calls may run on several threads
// at once.
class ScratchPool {
 public:
  static ScratchPool& instance() {
    static ScratchPool pool;
    return pool;
  }
  // A kept scratch of the runner's shape, renewed, or a new one.
  std::unique_ptr<Runner::Scratch> take(const Runner& runner) {
    const Runner::ScratchShape shape = runner.scratch_shape();
    std::unique_ptr<Runner::Scratch> found;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = kept_.rbegin(); it != kept_.rend(); ++it) {
        if ((*it)->shape == shape) {
          found = std::move(*it);
          kept_.erase(std::next(it).base());
          break;
        }
      }
    }
    if (!found) return std::make_unique<Runner::Scratch>(runner);
    found->renew(runner);
    return found;
  }
  void give(std::unique_ptr<Runner::Scratch> scratch) {
    if (!scratch || scratch->bytes() > kKeptScratchBytes) return;
    const std::lock_guard<std::mutex> lock(mutex_);
    if (kept_.size() == kKeptScratches) kept_.erase(kept_.begin());  // the oldest
    kept_.push_back(std::move(scratch));
  }

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<Runner::Scratch>> kept_;
};

void flash_attn(const FlashAttnParams& params, const std::vector<Sequence>& sequences,
                const Plan& plan, const Executor& executor, Isa isa, float* workspace,
                int64_t* worker_ns) {
  // The core entry point checks what it is given itself, whatever the binding checked before.
  validate(params, sequences, plan, isa, workspace);
  const Runner runner(params, sequences, plan, isa);
  const UnitWalker& walker = runner.walker();
  std::vector<std::unique_ptr<Runner::Scratch>> scratch(executor.num_workers());
  auto scratch_of = [&](int thread) -> Runner::Scratch& {
    if (!scratch[thread]) scratch[thread] = ScratchPool::instance().take(runner);
    return *scratch[thread];
  };
  // Workers whose stretch is empty take no part: when one worker holds all the work (a short
  // decode) it runs on the calling thread, with no parallel region to start and wait for.
  std::vector<int64_t> busy;
  busy.reserve(plan.workers.size());
  for (size_t w = 0; w < plan.workers.size(); ++w) {
    if (plan.workers[w].begin != plan.workers[w].end) {
      busy.push_back(static_cast<int64_t>(w));
    } else if (worker_ns != nullptr) {
      worker_ns[w] = 0;
    }
  }
  run_dynamic(executor, static_cast<int64_t>(busy.size()), [&](int64_t task, int thread) {
    const int64_t w = busy[task];
    const auto start = std::chrono::steady_clock::now();
    Runner::Scratch& sc = scratch_of(thread);
    const kernels::WorkerScope scope(runner.kernel_set());
    const WorkerRange& range = plan.workers[w];
    sc.stretch_end = walker.unit_index(range.end) + (walker.mid_unit(range.end) ? 1 : 0);
    // Consecutive whole units of one query tile and neighbouring key heads run side by side.
    struct {
      int32_t b = 0, t = 0, h0 = 0, h1 = 0;
      const TileSpan* sp = nullptr;
    } group;
    auto flush = [&] {
      if (group.h1 > group.h0) {
        runner.run_side_by_side(sc, group.b, group.h0, group.h1, group.t, *group.sp);
      }
      group.h1 = group.h0;
    };
    walker.for_each_piece(
        range.begin, range.end,
        [&](int32_t b, int32_t h, int32_t t, int32_t k_from, int32_t k_to, const TileSpan& sp) {
          if (!runner.side_by_side(b, k_from, k_to, sp)) {
            flush();
            runner.piece(sc, b, h, t, k_from, k_to, sp, range, workspace);
          } else if (group.h1 > group.h0 && group.b == b && group.t == t && group.h1 == h &&
                     group.h1 - group.h0 < runner.side_by_side_heads()) {
            ++group.h1;
          } else {
            flush();
            group = {b, t, h, h + 1, &sp};
          }
        });
    flush();
    if (worker_ns != nullptr) {
      worker_ns[w] = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now() - start)
                         .count();
    }
  });
  run_dynamic(executor, static_cast<int64_t>(plan.combines.size()), [&](int64_t c, int thread) {
    runner.combine(scratch_of(thread), plan.combines[c], workspace);
  });
  for (auto& sc : scratch) ScratchPool::instance().give(std::move(sc));
}

}  // namespace opmesh::core::attention
