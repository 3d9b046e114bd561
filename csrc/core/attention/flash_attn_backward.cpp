#include "flash_attn_backward.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "../aligned_buffer.h"
#include "../errors.h"
#include "../kernels/kernel_set.h"
#include "../kernels/row_loads.h"
#include "../kernels/rows_ahead.h"

namespace opmesh::core::attention {
namespace {

using kernels::KernelSet;
using kernels::LinesAhead;
using kernels::round_up;
using kernels::RowsAhead;

constexpr int64_t kTile = kKeyTile;  // keys per key tile, query positions per query tile
// Key tiles per pass-1 unit: each packed query tile serves this many key tiles.
constexpr int64_t kKeyBlock = 4;
constexpr float kInf = std::numeric_limits<float>::infinity();
// The cost model's constants (ns): one multiply-add of a product, one element packed. Only their
// ratio matters for the balance.
constexpr double kMacNs = 0.01;
constexpr double kPackNs = 0.5;

// Keys per block of the key pass and of the fused pass.
constexpr int64_t kBlockKeys = kKeyBlock * kTile;
// Units the fused pass (five products per tile pair instead of seven) aims for: fewer
// (sequence, key head) pairs would leave threads idle, so their keys are cut into chunks.
constexpr int64_t kFusedMinUnits = 8;
// The fused schedule's float32 dQ accumulator (one key head's query heads over the longest
// sequence) per worker thread is kept within this; longer sequences run the two passes. A thread
// holds one while it runs a unit, so together they never exceed the call's own dQ in float32
// (units x accumulator), whatever the thread count.
constexpr int64_t kFusedMaxBytes = int64_t{64} << 20;
// With fewer than kFusedMinUnits units the fused pass cuts each unit's keys into chunks, each with
// its own dQ accumulator for the call over the query tiles that see its keys, summed in chunk
// order at the end; all of them together stay within this (fewer chunks are taken where more
// would not fit).
constexpr int64_t kFusedChunkMaxBytes = int64_t{128} << 20;
// The fused pass's products run in pieces of this many rows (a multiple of every set's row
// block), with a share of the next query tile's rows asked for before each.
constexpr int64_t kAheadRows = 48;

// A dQ^T accumulator of one key head's query heads over the query tiles [first, first + count):
// [group][count][d][64] floats.
struct DqTiles {
  float* data;
  int64_t first, count;
  float* tile(int64_t g, int64_t t, int64_t d) const {
    return data + (g * count + t - first) * d * kTile;
  }
};

// A unit of one pass: (sequence b, head h, tile t). Pass 1: key head, key tile; pass 2: query
// head, query tile.
struct Unit {
  int32_t b, h, t;
};

class Backward {
 public:
  Backward(const FlashAttnBackwardParams& p, const std::vector<Sequence>& seqs, Isa isa)
      : p_(p),
        seqs_(seqs),
        k_(kernels::float32_set(isa)),
        kb_(kernels::select_set(isa, p.dtype, p.bf16_pairs, true)),
        pairs_(kb_.word == kernels::Word::kBf16Pair),
        mods_(p.softcap > 0.0f || p.alibi_slopes != nullptr),

        group_(p.config.num_heads_q / p.config.num_heads_kv),
        d_(p.config.head_dim),
        dv_(p.config.head_dim_v),
        dp_(round_up(d_, 16)),
        dvp_(round_up(dv_, 16)),
        dw_(round_up((d_ + 1) / 2, kb_.depth_align)),
        dwv_(round_up((dv_ + 1) / 2, kb_.depth_align)),
        mask_(mask_of(p.config)),
        elem_(p.dtype == DType::kFloat64   ? 8
              : p.dtype == DType::kFloat32 ? 4
                                           : 2) {
    int64_t total = 0;
    for (const Sequence& s : seqs) {
      delta_base_.push_back(total);
      total += s.q_len * p.config.num_heads_q;
    }
    delta_.assign(total, 0.0f);
  }

  struct Scratch {
    explicit Scratch(const Backward& r)
        : q(kTile * r.dp_),
          dout(kTile * r.dvp_),
          kt(kKeyBlock * r.d_ * kTile),
          vt(kKeyBlock * r.dv_ * kTile),
          krows(kTile * r.dp_),
          s(kTile * kTile),
          dp(kTile * kTile),
          trans(kTile * kTile),
          cap(kTile * kTile),
          acc(kKeyBlock * kTile * std::max(r.dp_, r.dvp_)),
          acc2(kKeyBlock * kTile * r.dvp_),
          row(std::max(r.dp_, r.dvp_)),
          ones(kTile),
          lse(kTile),
          delta(kTile) {
      std::fill(ones.data(), ones.data() + kTile, 1.0f);
    }
    AlignedBuffer<float> q;      // [positions][dp] query rows
    AlignedBuffer<float> dout;   // [positions][dvp] output-gradient rows
    AlignedBuffer<float> kt;     // per key tile of a block: [d][64] keys, transposed
    AlignedBuffer<float> vt;     // per key tile of a block: [dv][64] values, transposed
    AlignedBuffer<float> krows;  // [64][dp] key rows
    AlignedBuffer<float> s;      // [positions][64] probabilities, then dS
    AlignedBuffer<float> dp;     // [positions][64] dP
    AlignedBuffer<float> trans;  // [64][positions] a transpose of s
    AlignedBuffer<float> cap;    // [positions][64] the softcap's derivative

    AlignedBuffer<float> acc;   // dK or dQ accumulator
    AlignedBuffer<float> acc2;  // dV accumulator
    AlignedBuffer<float> row;
    AlignedBuffer<float> ones;
    AlignedBuffer<float> lse;
    AlignedBuffer<float> delta;  // D_i = dO_i . O_i
  };

  // Predicted cost of a unit: visible (query, key) pairs times the per-pair work (five products
  // of depth D or Dv per pair in pass 1, three in pass 2) plus the packing of its rows.
  double key_unit_cost(const Unit& u) const {
    const Sequence& seq = seqs_[u.b];
    const int64_t a = u.t * kKeyBlock * kTile;
    const int64_t e = std::min(seq.k_len, a + kKeyBlock * kTile);
    double pairs = 0.0, packed_tiles = 0.0;
    for (int64_t i0 = 0; i0 < seq.q_len; i0 += kTile) {
      const int64_t rows = std::min(kTile, seq.q_len - i0);
      const int64_t n = overlap(seq, i0, a, e) + overlap(seq, i0 + rows - 1, a, e);
      pairs += 0.5 * static_cast<double>(n) * static_cast<double>(rows);
      packed_tiles += n > 0 ? 1.0 : 0.0;
    }
    const double depth = 3.0 * d_ + 2.0 * dv_;
    return static_cast<double>(group_) *
           (pairs * depth * kMacNs + packed_tiles * kTile * (d_ + dv_) * kPackNs);
  }

  int64_t query_rows(const Unit& u) const {
    return std::min(kTile, seqs_[u.b].q_len - u.t * kTile);
  }

  double query_unit_cost(const Unit& u) const {
    const Sequence& seq = seqs_[u.b];
    const int64_t i0 = u.t * kTile;
    const int64_t rows = std::min(kTile, seq.q_len - i0);
    const KeyRange first = visible_keys(mask_, seq, i0);
    const KeyRange last = visible_keys(mask_, seq, i0 + rows - 1);
    const double pairs = 0.5 * static_cast<double>(rows) *
                         static_cast<double>((first.end - first.begin) + (last.end - last.begin));
    const double keys =
        static_cast<double>(std::max(last.end, first.end) - std::min(first.begin, last.begin));
    return pairs * (2.0 * d_ + dv_) * kMacNs + std::max(0.0, keys) * (d_ + dv_) * kPackNs;
  }

  std::vector<Unit> key_units() const {
    std::vector<Unit> units;
    for (int64_t b = 0; b < static_cast<int64_t>(seqs_.size()); ++b) {
      const int64_t tiles = (seqs_[b].k_len + kTile * kKeyBlock - 1) / (kTile * kKeyBlock);
      if (seqs_[b].q_len == 0) continue;
      for (int64_t h = 0; h < p_.config.num_heads_kv; ++h)
        for (int64_t t = 0; t < tiles; ++t) units.push_back(unit(b, h, t));
    }
    return units;
  }

  std::vector<Unit> query_units() const {
    std::vector<Unit> units;
    for (int64_t b = 0; b < static_cast<int64_t>(seqs_.size()); ++b) {
      const int64_t tiles = (seqs_[b].q_len + kTile - 1) / kTile;
      for (int64_t h = 0; h < p_.config.num_heads_q; ++h)
        for (int64_t t = 0; t < tiles; ++t) units.push_back(unit(b, h, t));
    }
    return units;
  }

  // Pass 1: dK and dV of the key tiles of block u.t of key head u.h, over every query head of
  // its group and every query tile that sees them; each query tile is packed once per block.
  void key_block(Scratch& sc, const Unit& u) const {
    const Sequence& seq = seqs_[u.b];
    const int64_t first = u.t * kKeyBlock * kTile;
    const int64_t tiles = std::min(kKeyBlock, (seq.k_len - first + kTile - 1) / kTile);
    for (int64_t i = 0; i < tiles; ++i) {
      const int64_t k0 = first + i * kTile;
      pack_keys(sc, u.b, u.h, k0, std::min(kTile, seq.k_len - k0), i);
    }
    float* dk = sc.acc.data();
    float* dv = sc.acc2.data();
    std::fill(dk, dk + tiles * kTile * dp_, 0.0f);
    std::fill(dv, dv + tiles * kTile * dvp_, 0.0f);
    for (int64_t g = 0; g < group_; ++g) {
      const int64_t head = u.h * group_ + g;
      for (int64_t i0 = 0; i0 < seq.q_len; i0 += kTile) {
        const int64_t rows = std::min(kTile, seq.q_len - i0);
        if (!sees_keys(seq, i0, rows, first, std::min(tiles * kTile, seq.k_len - first))) continue;
        pack_queries(sc, u.b, head, i0, rows);
        for (int64_t i = 0; i < tiles; ++i) {
          const int64_t k0 = first + i * kTile;
          if (!sees_keys(seq, i0, rows, k0, std::min(kTile, seq.k_len - k0))) continue;
          probabilities_and_ds(sc, seq, head, i0, rows, k0, i);
          // dV += P^T dO, dK += scale dS^T Q (sc.trans holds P^T, then dS^T).
          float* dvi = dv + i * kTile * dvp_;
          float* dki = dk + i * kTile * dp_;
          transpose(sc.dp.data(), rows, sc.trans.data());
          k_.gemm({sc.trans.data(), rows, sc.dout.data(), dvp_, dvi, dvp_, kTile, dvp_, rows,
                   sc.ones.data(), 1.0f});
          transpose(sc.s.data(), rows, sc.trans.data());
          k_.gemm({sc.trans.data(), rows, sc.q.data(), dp_, dki, dp_, kTile, dp_, rows,
                   sc.ones.data(), p_.softmax_scale});
        }
      }
    }
    store_key_rows(u, first, std::min(tiles * kTile, seq.k_len - first), dk, dv);
  }

  // D_i = dO_i . O_i (minus the lse's gradient) for query tile u.t of query head u.h, computed
  // once before the passes that need it. Returns the tile's share of -dsink (the sum of
  // exp(sink - lse_i) D_i), 0 without sinks.
  double deltas(Scratch& sc, const Unit& u) {
    const Sequence& seq = seqs_[u.b];
    const int64_t i0 = u.t * kTile;
    const int64_t rows = std::min(kTile, seq.q_len - i0);
    float* g = sc.dout.data();
    double part = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = seq.q_begin + i0 + r;
      const View& go = p_.dout;
      const View& o = p_.out;
      load(go.data, u.b * go.sb + pos * go.ss + u.h * go.sn, go.sd, dv_, g);
      load(o.data, u.b * o.sb + pos * o.ss + u.h * o.sn, o.sd, dv_, sc.row.data());
      double delta = 0.0;
      for (int64_t e = 0; e < dv_; ++e) delta += static_cast<double>(g[e]) * sc.row.data()[e];
      if (p_.dlse != nullptr) {
        delta -= p_.dlse[u.b * p_.dlse_sb + u.h * p_.dlse_sn + pos * p_.dlse_ss];
      }
      const float d = static_cast<float>(delta);
      delta_[delta_index(u.b, u.h, i0 + r)] = d;
      if (p_.sinks != nullptr) {
        const float lse = p_.lse[u.b * p_.lse_sb + u.h * p_.lse_sn + pos * p_.lse_ss];
        // A row nothing reached (or an infinite sink) has no term.
        if (lse != kInf) part += std::exp(static_cast<double>(p_.sinks[u.h]) - lse) * d;
      }
    }
    return part;
  }

  // Pass 2: dQ of query tile u.t of query head u.h over every key tile it sees.
  void query_tile(Scratch& sc, const Unit& u) const {
    const Sequence& seq = seqs_[u.b];
    const int64_t i0 = u.t * kTile;
    const int64_t rows = std::min(kTile, seq.q_len - i0);
    const int64_t kv_head = u.h / group_;
    pack_queries(sc, u.b, u.h, i0, rows);
    float* dq = sc.acc.data();
    std::fill(dq, dq + kTile * dp_, 0.0f);
    int64_t lo = seq.k_len, hi = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const KeyRange vr = visible_keys(mask_, seq, i0 + r);
      if (vr.end > vr.begin) {
        lo = std::min(lo, vr.begin);
        hi = std::max(hi, vr.end);
      }
    }
    for (int64_t k0 = lo / kTile * kTile; k0 < hi; k0 += kTile) {
      const int64_t keys = std::min(kTile, seq.k_len - k0);
      pack_keys(sc, u.b, kv_head, k0, keys, 0);
      probabilities_and_ds(sc, seq, u.h, i0, rows, k0, 0);
      // dQ += scale dS K.
      k_.gemm({sc.s.data(), kTile, sc.krows.data(), dp_, dq, dp_, rows, dp_, kTile, sc.ones.data(),
               p_.softmax_scale});
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = seq.q_begin + i0 + r;
      const MutableView& gq = p_.dq;
      store_row(k_, gq.data, p_.dtype, u.b * gq.sb + pos * gq.ss + u.h * gq.sn, gq.sd, d_,
                dq + r * dp_, 1.0f);
    }
  }

  // The fused single pass over one (sequence, key head) unit: for each block of four key tiles
  // and each query tile of the group's heads that sees it, the five products with the keys as
  // rows (S^T = K Q^T and dP^T = V dO^T, so P^T and dS^T feed dV += P^T dO and
  // dK += dS^T Q without a transpose, and dQ^T += K^T dS^T). dQ^T accumulates in float32 per
  // query tile of the group's heads for the whole unit, which owns those rows: no race.
  struct FusedScratch {
    FusedScratch(const Backward& r, int64_t tiles)
        : krows(kBlockKeys * r.dp_),
          vrows(kBlockKeys * r.dvp_),
          kt(kKeyBlock * r.d_ * kTile),
          qrows(kTile * r.dp_),
          qt(r.d_ * kTile),
          orows(kTile * r.dvp_),
          ot(r.dv_ * kTile),
          st(kBlockKeys * kTile),
          dpt(kBlockKeys * kTile),
          cap(kBlockKeys * kTile),
          dk(kBlockKeys * r.dp_),
          dv(kBlockKeys * r.dvp_),
          dq(std::max<int64_t>(1, r.group_ * tiles * r.d_ * kTile)),
          row(std::max(r.dp_, r.dvp_)),
          ones(std::max(kBlockKeys, r.d_)),
          zeros(kBlockKeys),
          lse(kTile),
          delta(kTile),
          lo(kTile),
          hi(kTile),
          ahead(2 * kTile),
          capacity(tiles) {
      std::fill(ones.data(), ones.data() + std::max(kBlockKeys, r.d_), 1.0f);
      std::fill(zeros.data(), zeros.data() + kBlockKeys, 0.0f);
    }
    AlignedBuffer<float> krows, vrows;  // [256][dp], [256][dvp] key and value rows of a block
    AlignedBuffer<float> kt;            // [d][256] the block's keys, transposed
    AlignedBuffer<float> qrows, qt;     // [64][dp] query rows, [d][64] transposed
    AlignedBuffer<float> orows, ot;     // [64][dvp] output-gradient rows, [dv][64] transposed
    AlignedBuffer<float> st, dpt;       // [256][64] S^T then P^T, dP^T then dS^T
    AlignedBuffer<float> cap;           // [256][64] the softcap's derivative
    AlignedBuffer<float> dk, dv;        // [256][dp], [256][dvp] accumulators of the block
    AlignedBuffer<float> dq;            // [group][tile][d][64] dQ^T of the unit's query rows
    AlignedBuffer<float> row, ones, zeros, lse, delta;
    std::vector<int64_t> lo, hi;     // visible keys of each query row of a tile
    std::vector<const char*> ahead;  // the next tile's query and output-gradient rows
    int64_t capacity;                // query tiles dq holds
  };

  int64_t max_query_tiles() const {
    int64_t most = 0;
    for (const Sequence& s : seqs_) most = std::max(most, (s.q_len + kTile - 1) / kTile);
    return most;
  }

  int64_t key_blocks(int64_t b) const { return (seqs_[b].k_len + kBlockKeys - 1) / kBlockKeys; }

  int64_t max_key_blocks() const {
    int64_t most = 0;
    for (int64_t b = 0; b < static_cast<int64_t>(seqs_.size()); ++b) {
      most = std::max(most, key_blocks(b));
    }
    return most;
  }

  int64_t fused_pairs() const {
    int64_t pairs = 0;
    for (const Sequence& s : seqs_) pairs += s.q_len > 0 && s.k_len > 0;
    return pairs * p_.config.num_heads_kv;
  }

  // The key blocks [first, last) of chunk u.t of `chunks` of unit u's keys.
  std::pair<int64_t, int64_t> chunk_blocks(const Unit& u, int64_t chunks) const {
    const int64_t blocks = key_blocks(u.b);
    return {u.t * blocks / chunks, (u.t + 1) * blocks / chunks};
  }

  // The query tiles [first, last) of unit u's sequence that see keys of chunk u.t of `chunks`.
  std::pair<int64_t, int64_t> chunk_tiles(const Unit& u, int64_t chunks) const {
    const Sequence& seq = seqs_[u.b];
    const auto [first_block, last_block] = chunk_blocks(u, chunks);
    const int64_t k0 = first_block * kBlockKeys;
    const int64_t nk = std::min(seq.k_len, last_block * kBlockKeys) - k0;
    int64_t first = 0, last = 0;
    for (int64_t i0 = 0; i0 < seq.q_len; i0 += kTile) {
      if (!sees_keys(seq, i0, std::min(kTile, seq.q_len - i0), k0, nk)) continue;
      if (last == 0) first = i0 / kTile;
      last = i0 / kTile + 1;
    }
    return {first, last};
  }

  // The fused pass's units: (sequence, key head, chunk) for every chunk that holds key blocks,
  // the chunks of one (sequence, key head) next to each other in order.
  std::vector<Unit> fused_units(int64_t chunks) const {
    std::vector<Unit> units;
    for (int64_t b = 0; b < static_cast<int64_t>(seqs_.size()); ++b) {
      if (seqs_[b].q_len == 0 || seqs_[b].k_len == 0) continue;
      for (int64_t h = 0; h < p_.config.num_heads_kv; ++h) {
        for (int64_t c = 0; c < chunks; ++c) {
          const Unit u = unit(b, h, c);
          const auto [first, last] = chunk_blocks(u, chunks);
          if (first < last) units.push_back(u);
        }
      }
    }
    return units;
  }

  double fused_unit_cost(const Unit& u, int64_t chunks) const {
    double cost = 0.0;
    const auto [first, last] = chunk_blocks(u, chunks);
    for (int64_t t = first; t < last; ++t) cost += key_unit_cost(unit(u.b, u.h, t));
    return cost;
  }

  // Floats of a whole unit's dQ^T accumulator ([group][tile][d][64] over the longest sequence).
  int64_t chunk_floats() const { return group_ * max_query_tiles() * d_ * kTile; }

  // Where each chunked unit's dQ^T accumulator starts in the call's buffer ([group][tile][d][64]
  // over the query tiles that see its keys), in unit order; the last entry is the total.
  std::vector<int64_t> chunk_offsets(const std::vector<Unit>& units, int64_t chunks) const {
    std::vector<int64_t> offsets{0};
    for (const Unit& u : units) {
      const auto [first, last] = chunk_tiles(u, chunks);
      offsets.push_back(offsets.back() + group_ * (last - first) * d_ * kTile);
    }
    return offsets;
  }

  // fn(k0, nk) for each key block of chunk u.t of `chunks` that some query row of the unit sees.
  template <class Fn>
  void for_each_key_block(const Unit& u, int64_t chunks, Fn&& fn) const {
    const Sequence& seq = seqs_[u.b];
    const auto [first, last] = chunk_blocks(u, chunks);
    for (int64_t k0 = first * kBlockKeys; k0 < std::min(seq.k_len, last * kBlockKeys);
         k0 += kBlockKeys) {
      const int64_t nk = std::min(kBlockKeys, seq.k_len - k0);
      if (sees_keys(seq, 0, seq.q_len, k0, nk)) fn(k0, nk);
    }
  }

  // Unit u, chunk u.t of `chunks`. A whole unit accumulates dQ^T in the scratch and stores it;
  // a chunk accumulates into `chunk_dq` (its own, over the tiles chunk_tiles names) for
  // store_chunks_dq to sum.
  void fused_unit(FusedScratch& fs, const Unit& u, int64_t chunks, float* chunk_dq) const {
    const Sequence& seq = seqs_[u.b];
    const int64_t tiles = (seq.q_len + kTile - 1) / kTile;
    const DqTiles dq_all = own_dq(u, chunks, fs.dq.data(), chunk_dq);
    for_each_key_block(u, chunks, [&](int64_t k0, int64_t nk) {
      fused_pack_keys(fs, u.b, u.h, k0, nk);
      std::fill(fs.dk.data(), fs.dk.data() + nk * dp_, 0.0f);
      std::fill(fs.dv.data(), fs.dv.data() + nk * dvp_, 0.0f);
      for (int64_t g = 0; g < group_; ++g) {
        const int64_t head = u.h * group_ + g;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t i0 = t * kTile;
          const int64_t rows = std::min(kTile, seq.q_len - i0);
          if (!sees_keys(seq, i0, rows, k0, nk)) continue;
          fused_pack_queries(fs, u.b, head, i0, rows);
          // Key rows past the last key any of these queries sees have P = dS = 0: skipped.
          const int64_t m = keys_seen(fs.hi.data(), rows, k0, nk);
          const int64_t pieces =
              4 * ((m + kAheadRows - 1) / kAheadRows) + (d_ + kAheadRows - 1) / kAheadRows;
          LinesAhead ahead(next_query_rows(fs.ahead, u, g, t, k0, nk), pieces);
          float* st = fs.st.data();
          float* dpt = fs.dpt.data();
          gemm_ahead(k_, ahead,
                     {fs.krows.data(), dp_, fs.qt.data(), kTile, st, kTile, m, kTile, d_, nullptr,
                      p_.softmax_scale});
          gemm_ahead(k_, ahead,
                     {fs.vrows.data(), dvp_, fs.ot.data(), kTile, dpt, kTile, m, kTile, dv_,
                      nullptr, 1.0f});
          if (mods_) modify_key_rows(st, m, seq, head, i0, k0, fs.cap.data());
          shift_key_rows(st, m, rows, k0, fs.lse.data(), fs.lo.data(), fs.hi.data());
          k_.exp_rows(st, m, kTile, fs.zeros.data());  // P^T
          for (int64_t k = 0; k < m; ++k) {
            k_.rows.probability_gradient(st + k * kTile, dpt + k * kTile, fs.delta.data());  // dS^T
            if (p_.softcap > 0.0f)
              k_.rows.multiply_into(dpt + k * kTile, fs.cap.data() + k * kTile);
          }
          // dV += P^T dO, dK += scale dS^T Q, dQ^T += scale K^T dS^T (per key tile).
          gemm_ahead(k_, ahead,
                     {st, kTile, fs.orows.data(), dvp_, fs.dv.data(), dvp_, m, dvp_, rows,
                      fs.ones.data(), 1.0f});
          gemm_ahead(k_, ahead,
                     {dpt, kTile, fs.qrows.data(), dp_, fs.dk.data(), dp_, m, dp_, rows,
                      fs.ones.data(), p_.softmax_scale});
          float* dq = dq_all.tile(g, t, d_);
          gemm_ahead(k_, ahead,
                     {fs.kt.data(), kBlockKeys, dpt, kTile, dq, kTile, d_, kTile, m, fs.ones.data(),
                      p_.softmax_scale});
        }
      }
      store_key_rows(u, k0, nk, fs.dk.data(), fs.dv.data());
    });
    if (chunks == 1) store_transposed_dq(u, &dq_all, 1, fs.row.data());
  }

  // The dQ^T accumulator of unit u (chunk u.t of `chunks`), zeroed: the whole sequence's tiles in
  // `whole` for one chunk, else the tiles that see the chunk's keys in `chunk`.
  DqTiles own_dq(const Unit& u, int64_t chunks, float* whole, float* chunk) const {
    DqTiles dq{whole, 0, (seqs_[u.b].q_len + kTile - 1) / kTile};
    if (chunks > 1) {
      const auto [first, last] = chunk_tiles(u, chunks);
      dq = DqTiles{chunk, first, last - first};
    }
    std::fill(dq.data, dq.data + group_ * dq.count * d_ * kTile, 0.0f);
    return dq;
  }

  // ---- bf16 pairs: the same schedules with every product on kb_ ----

  // Per-thread operands of the pair products. Keys and values as rows of pairs along the head
  // dims (A of S^T = K Q^T and dP^T = V dO^T) and as key pairs (ktp: K^T for dQ^T = K^T dS^T;
  // krp: K for the query pass's dQ = dS K); query and output-gradient rows as pairs, transposed
  // (B of S^T and dP^T) and as position pairs (qi, oi: B of dK += dS^T Q and dV += P^T dO).
  struct PairScratch {
    PairScratch(const Backward& r, int64_t tiles)
        : kr(kBlockKeys * r.dw_),
          vr(kBlockKeys * r.dwv_),
          ktp(round_up(r.d_, 16) * (kBlockKeys / 2)),
          kq(r.dw_ * kTile),
          vq(r.dwv_ * kTile),
          krp(kTile / 2 * r.dp_),
          qrows(kTile * r.dw_),
          qt(r.dw_ * kTile),
          qi(kTile / 2 * r.dp_),
          orows(kTile * r.dwv_),
          ot(r.dwv_ * kTile),
          oi(kTile / 2 * r.dvp_),
          st(kBlockKeys * kTile),
          dpt(kBlockKeys * kTile),
          cap(kBlockKeys * kTile),
          p16(kBlockKeys * kTile),
          ds16(kBlockKeys * kTile),
          dsi(kBlockKeys / 2 * kTile),
          dk(kBlockKeys * std::max(r.dp_, r.dvp_)),
          dv(kBlockKeys * r.dvp_),
          dq(std::max<int64_t>(1, r.group_ * tiles * r.d_ * kTile)),
          row(std::max(r.dp_, r.dvp_)),
          ones(kBlockKeys),
          zeros(kBlockKeys),
          lse(kTile),
          delta(kTile),
          lo(kTile),
          hi(kTile),
          ahead(2 * kTile) {
      std::fill(ones.data(), ones.data() + kBlockKeys, 1.0f);
      std::fill(zeros.data(), zeros.data() + kBlockKeys, 0.0f);
      // Padding rows and columns no pack writes stay zero.
      std::fill(ktp.data(), ktp.data() + round_up(r.d_, 16) * (kBlockKeys / 2), 0u);
      std::fill(krp.data(), krp.data() + kTile / 2 * r.dp_, 0u);
      std::fill(qi.data(), qi.data() + kTile / 2 * r.dp_, 0u);
      std::fill(oi.data(), oi.data() + kTile / 2 * r.dvp_, 0u);
    }
    AlignedBuffer<uint32_t> kr, vr, ktp, kq, vq, krp;
    AlignedBuffer<uint32_t> qrows, qt, qi, orows, ot, oi;
    AlignedBuffer<float> st, dpt;  // [256][64] S^T then P^T, dP^T then dS^T (or S, dP)
    AlignedBuffer<float> cap;      // [256][64] the softcap's derivative

    AlignedBuffer<uint16_t> p16, ds16;  // P^T and dS^T (or dS) in bf16
    AlignedBuffer<uint32_t> dsi;        // [128][64] dS^T as key pairs
    AlignedBuffer<float> dk, dv, dq;    // accumulators (the query pass's dQ in dk)
    AlignedBuffer<float> row, ones, zeros, lse, delta;
    std::vector<int64_t> lo, hi;
    std::vector<const char*> ahead;  // the next tile's query and output-gradient rows
  };

  bool pairs() const { return pairs_; }
  const KernelSet& products() const { return kb_; }

  // The fused unit on pairs, as fused_unit.
  void pair_fused_unit(PairScratch& ps, const Unit& u, int64_t chunks, float* chunk_dq) const {
    const DqTiles dq = own_dq(u, chunks, ps.dq.data(), chunk_dq);
    for_each_key_block(u, chunks,
                       [&](int64_t k0, int64_t nk) { pair_key_block(ps, u, k0, nk, dq); });
    if (chunks == 1) store_transposed_dq(u, &dq, 1, ps.row.data());
  }

  // The pair of units `first` .. `first + count - 1` (the chunks of one sequence and key head,
  // in order; their accumulators chunk_dq apart in `chunk_dq`): the chunks' dQ^T summed in chunk
  // order, to dq.
  void store_chunks_dq(const std::vector<Unit>& units, int64_t first, int64_t count, int64_t chunks,
                       float* chunk_dq, const std::vector<int64_t>& offsets) const {
    std::vector<DqTiles> parts;
    for (int64_t i = first; i < first + count; ++i) {
      const auto [t0, t1] = chunk_tiles(units[i], chunks);
      parts.push_back(DqTiles{chunk_dq + offsets[i], t0, t1 - t0});
    }
    std::vector<float> row(d_);
    store_transposed_dq(units[first], parts.data(), count, row.data());
  }

  // Pass 1 on pairs: block u.t of key head u.h.
  void pair_key_unit(PairScratch& ps, const Unit& u) const {
    const int64_t k0 = u.t * kBlockKeys;
    pair_key_block(ps, u, k0, std::min(kBlockKeys, seqs_[u.b].k_len - k0), DqTiles{nullptr, 0, 0});
  }

  // Pass 2 on pairs: dQ of query tile u.t of query head u.h, with the queries as rows.
  void pair_query_tile(PairScratch& ps, const Unit& u) const {
    const Sequence& seq = seqs_[u.b];
    const int64_t i0 = u.t * kTile;
    const int64_t rows = std::min(kTile, seq.q_len - i0);
    pair_pack_queries(ps, u.b, u.h, i0, rows, false);
    float* dq = ps.dk.data();
    std::fill(dq, dq + kTile * dp_, 0.0f);
    int64_t lo = seq.k_len, hi = 0;
    for (int64_t r = 0; r < rows; ++r) {
      if (ps.hi[r] > ps.lo[r]) lo = std::min(lo, ps.lo[r]), hi = std::max(hi, ps.hi[r]);
    }
    const char* krows[kTile];
    const char* vrows[kTile];
    for (int64_t n = 0; n < kTile; ++n) {
      krows[n] = reinterpret_cast<const char*>(ps.kr.data() + n * dw_);
      vrows[n] = reinterpret_cast<const char*>(ps.vr.data() + n * dwv_);
    }
    float* s = ps.st.data();
    float* dp = ps.dpt.data();
    for (int64_t k0 = lo / kTile * kTile; k0 < hi; k0 += kTile) {
      const int64_t keys = std::min(kTile, seq.k_len - k0);
      pair_pack_keys(ps, u.b, u.h / group_, k0, keys, false);
      k_.pack_keys(krows, keys, dw_, ps.kq.data());
      k_.pack_keys(vrows, keys, dwv_, ps.vq.data());
      interleave_rows(reinterpret_cast<const uint16_t*>(ps.kr.data()), 2 * dw_, kTile, d_,
                      ps.krp.data(), dp_);
      kb_.gemm({ps.qrows.data(), dw_, ps.kq.data(), kTile, s, kTile, rows, kTile, dw_, nullptr,
                p_.softmax_scale});
      kb_.gemm({ps.orows.data(), dwv_, ps.vq.data(), kTile, dp, kTile, rows, kTile, dwv_, nullptr,
                1.0f});
      if (mods_) modify_query_rows(s, rows, seq, u.h, i0, k0, ps.cap.data());
      k_.exp_rows(s, rows, kTile, ps.lse.data());
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t a = std::clamp<int64_t>(ps.lo[r] - k0, 0, kTile);
        const int64_t e = ps.hi[r] > ps.lo[r] ? std::clamp<int64_t>(ps.hi[r] - k0, 0, kTile) : 0;
        const float delta = ps.delta.data()[r];
        const bool any = ps.lse.data()[r] != kInf;
        float* sr = s + r * kTile;
        const float* dr = dp + r * kTile;
        for (int64_t c = 0; c < kTile; ++c) {
          sr[c] = (any && c >= a && c < e) ? sr[c] * (dr[c] - delta) : 0.0f;  // dS
        }
        if (p_.softcap > 0.0f) k_.rows.multiply_into(sr, ps.cap.data() + r * kTile);
      }
      kb_.to_bf16(s, ps.ds16.data(), rows * kTile);
      // dQ += scale dS K.
      kb_.gemm({ps.ds16.data(), kTile / 2, ps.krp.data(), dp_, dq, dp_, rows, dp_, kTile / 2,
                ps.ones.data(), p_.softmax_scale});
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = seq.q_begin + i0 + r;
      const MutableView& gq = p_.dq;
      store_row(k_, gq.data, p_.dtype, u.b * gq.sb + pos * gq.ss + u.h * gq.sn, gq.sd, d_,
                dq + r * dp_, 1.0f);
    }
  }

 private:
  float slope(const Sequence& seq, int64_t head) const {
    return p_.alibi_slopes != nullptr ? p_.alibi_slopes[seq.batch * p_.alibi_sb + head] : 0.0f;
  }

  // softcap and ALiBi on m rows of S^T (key k0 + k against query positions i0 + c) of query head
  // `head`, the softcap's derivative in deriv.
  void modify_key_rows(float* st, int64_t m, const Sequence& seq, int64_t head, int64_t i0,
                       int64_t k0, float* deriv) const {
    const float sl = slope(seq, head);
    const bool capped = p_.softcap > 0.0f;
    for (int64_t k = 0; k < m; ++k) {
      k_.rows.score_mods(st + k * kTile, p_.softcap, sl, i0 + seq.diag() - (k0 + k), 1,
                         capped ? deriv + k * kTile : nullptr);
    }
  }

  // The same on `rows` rows of S (query position i0 + r against keys k0 + c).
  void modify_query_rows(float* s, int64_t rows, const Sequence& seq, int64_t head, int64_t i0,
                         int64_t k0, float* deriv) const {
    const float sl = slope(seq, head);
    const bool capped = p_.softcap > 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      k_.rows.score_mods(s + r * kTile, p_.softcap, sl, i0 + r + seq.diag() - k0, -1,
                         capped ? deriv + r * kTile : nullptr);
    }
  }

  // dK and dV rows [k0, k0 + nk) of key head u.h from the block's accumulators.
  void store_key_rows(const Unit& u, int64_t k0, int64_t nk, const float* dk,
                      const float* dv) const {
    const Sequence& seq = seqs_[u.b];
    for (int64_t n = 0; n < nk; ++n) {
      const int64_t key = seq.k_begin + k0 + n;
      const MutableView& gk = p_.dk;
      const MutableView& gv = p_.dv;
      store_row(k_, gk.data, p_.dtype, u.b * gk.sb + key * gk.ss + u.h * gk.sn, gk.sd, d_,
                dk + n * dp_, 1.0f);
      store_row(k_, gv.data, p_.dtype, u.b * gv.sb + key * gv.ss + u.h * gv.sn, gv.sd, dv_,
                dv + n * dvp_, 1.0f);
    }
  }

  // The sum, in order, of `count` dQ^T accumulators of unit u's chunks (each over its tiles;
  // zero elsewhere) to the dq rows of key head u.h's query heads.
  void store_transposed_dq(const Unit& u, const DqTiles* dqt, int64_t count, float* row) const {
    const Sequence& seq = seqs_[u.b];
    for (int64_t g = 0; g < group_; ++g) {
      const int64_t head = u.h * group_ + g;
      for (int64_t i = 0; i < seq.q_len; ++i) {
        const int64_t t = i / kTile;
        bool first = true;
        for (int64_t c = 0; c < count; ++c) {
          if (t < dqt[c].first || t >= dqt[c].first + dqt[c].count) continue;
          const float* col = dqt[c].tile(g, t, d_) + i % kTile;
          if (first) {
            for (int64_t e = 0; e < d_; ++e) row[e] = col[e * kTile];
          } else {
            for (int64_t e = 0; e < d_; ++e) row[e] += col[e * kTile];
          }
          first = false;
        }
        if (first) std::fill(row, row + d_, 0.0f);
        const int64_t pos = seq.q_begin + i;
        const MutableView& gq = p_.dq;
        store_row(k_, gq.data, p_.dtype, u.b * gq.sb + pos * gq.ss + head * gq.sn, gq.sd, d_, row,
                  1.0f);
      }
    }
  }

  // Keys [k0, k0 + nk) of key head u.h (nk <= 256) against every query tile of the group that
  // sees them: dK and dV of the block, and with dq ([group][tiles][d][64], dQ^T) its share of
  // dQ. The five products of a tile pair take the keys as rows, as the fused float32 unit.
  void pair_key_block(PairScratch& ps, const Unit& u, int64_t k0, int64_t nk,
                      const DqTiles& dq) const {
    const Sequence& seq = seqs_[u.b];
    pair_pack_keys(ps, u.b, u.h, k0, nk, dq.data != nullptr);
    std::fill(ps.dk.data(), ps.dk.data() + nk * dp_, 0.0f);
    std::fill(ps.dv.data(), ps.dv.data() + nk * dvp_, 0.0f);
    float* st = ps.st.data();
    float* dpt = ps.dpt.data();
    for (int64_t g = 0; g < group_; ++g) {
      const int64_t head = u.h * group_ + g;
      for (int64_t i0 = 0; i0 < seq.q_len; i0 += kTile) {
        const int64_t rows = std::min(kTile, seq.q_len - i0);
        if (!sees_keys(seq, i0, rows, k0, nk)) continue;
        pair_pack_queries(ps, u.b, head, i0, rows, true);
        // Key rows past the last key any of these queries sees are skipped, in steps of 32
        // (whole pairs, and whole 16-word depth tiles of the dQ^T product).
        int64_t hi = 0;
        for (int64_t r = 0; r < rows; ++r) hi = std::max(hi, ps.hi[r]);
        const int64_t m = round_up(std::clamp<int64_t>(hi - k0, 1, nk), 32);
        const int64_t mm = std::min(m, nk);
        const int64_t pieces = 2 * ((m + kAheadRows - 1) / kAheadRows) +
                               2 * ((mm + kAheadRows - 1) / kAheadRows) +
                               (dq.data != nullptr ? (d_ + kAheadRows - 1) / kAheadRows : 0);
        LinesAhead ahead(next_query_rows(ps.ahead, u, g, i0 / kTile, k0, nk), pieces);
        gemm_ahead(kb_, ahead,
                   {ps.kr.data(), dw_, ps.qt.data(), kTile, st, kTile, m, kTile, dw_, nullptr,
                    p_.softmax_scale});
        gemm_ahead(
            kb_, ahead,
            {ps.vr.data(), dwv_, ps.ot.data(), kTile, dpt, kTile, m, kTile, dwv_, nullptr, 1.0f});
        if (mods_) modify_key_rows(st, m, seq, head, i0, k0, ps.cap.data());

        shift_key_rows(st, m, rows, k0, ps.lse.data(), ps.lo.data(), ps.hi.data());
        k_.exp_rows(st, m, kTile, ps.zeros.data());  // P^T
        for (int64_t k = 0; k < m; ++k) {
          k_.rows.probability_gradient(st + k * kTile, dpt + k * kTile, ps.delta.data());  // dS^T
          if (p_.softcap > 0.0f) k_.rows.multiply_into(dpt + k * kTile, ps.cap.data() + k * kTile);
        }
        kb_.to_bf16(st, ps.p16.data(), m * kTile);
        kb_.to_bf16(dpt, ps.ds16.data(), m * kTile);
        // dV += P^T dO, dK += scale dS^T Q.
        gemm_ahead(kb_, ahead,
                   {ps.p16.data(), kTile / 2, ps.oi.data(), dvp_, ps.dv.data(), dvp_, mm, dvp_,
                    kTile / 2, ps.ones.data(), 1.0f});
        gemm_ahead(kb_, ahead,
                   {ps.ds16.data(), kTile / 2, ps.qi.data(), dp_, ps.dk.data(), dp_, mm, dp_,
                    kTile / 2, ps.ones.data(), p_.softmax_scale});
        if (dq.data != nullptr) {
          // dQ^T += scale K^T dS^T, over key pairs.
          for (int64_t k = 0; k < m / 2; ++k) {
            k_.rows.pair_rows(dpt + 2 * k * kTile, dpt + (2 * k + 1) * kTile,
                              ps.dsi.data() + k * kTile);
          }
          float* dqt = dq.tile(g, i0 / kTile, d_);
          gemm_ahead(kb_, ahead,
                     {ps.ktp.data(), kBlockKeys / 2, ps.dsi.data(), kTile, dqt, kTile, d_, kTile,
                      m / 2, ps.ones.data(), p_.softmax_scale});
        }
      }
    }
    store_key_rows(u, k0, nk, ps.dk.data(), ps.dv.data());
  }

  // out[l][e] = rows[2l][e] | rows[2l + 1][e] << 16 for e < n, l < count / 2: bf16 rows (ld
  // elements apart) paired along their index, out's rows ld_out words apart.
  void interleave_rows(const uint16_t* rows, int64_t ld, int64_t count, int64_t n, uint32_t* out,
                       int64_t ld_out) const {
    for (int64_t l = 0; 2 * l < count; ++l) {
      k_.rows.interleave_bf16(rows + 2 * l * ld, rows + (2 * l + 1) * ld, n, out + l * ld_out);
    }
  }

  // A bf16 row of n elements (stride sd) as ceil(n / 2) pair words.
  void load_pairs(const View& view, int64_t offset, int64_t n, uint32_t* dst) const {
    if (view.sd == 1 && n % 2 == 0) {
      std::memcpy(dst, static_cast<const uint16_t*>(view.data) + offset, n * 2);
    } else {
      load_row_bf16_pairs(view.data, offset, view.sd, n, dst);
    }
  }

  // Key and value rows [k0, k0 + nk) of key head h as pairs along the head dims (zero to 256
  // rows, or to 64 when !block), and with `transposed` the keys as key pairs (ktp).
  void pair_pack_keys(PairScratch& ps, int64_t b, int64_t h, int64_t k0, int64_t nk,
                      bool transposed) const {
    const Sequence& seq = seqs_[b];
    const int64_t cap = transposed || nk > kTile ? kBlockKeys : kTile;
    std::fill(ps.kr.data(), ps.kr.data() + cap * dw_, 0u);
    std::fill(ps.vr.data(), ps.vr.data() + cap * dwv_, 0u);
    for (int64_t n = 0; n < nk; ++n) {
      const int64_t key = seq.k_begin + k0 + n;
      const View& k = p_.k;
      const View& v = p_.v;
      load_pairs(k, b * k.sb + key * k.ss + h * k.sn, d_, ps.kr.data() + n * dw_);
      load_pairs(v, b * v.sb + key * v.ss + h * v.sn, dv_, ps.vr.data() + n * dwv_);
    }
    if (!transposed) return;
    // ktp[e][l] = (K[2l][e], K[2l + 1][e]).
    const uint16_t* k16 = reinterpret_cast<const uint16_t*>(ps.kr.data());
    const int64_t ld = 2 * dw_;
    uint32_t* ktp = ps.ktp.data();
    for (int64_t l = 0; l < kBlockKeys / 2; ++l) {
      const uint16_t* r0 = k16 + 2 * l * ld;
      const uint16_t* r1 = r0 + ld;
      for (int64_t e = 0; e < d_; ++e) {
        ktp[e * (kBlockKeys / 2) + l] = r0[e] | (static_cast<uint32_t>(r1[e]) << 16);
      }
    }
  }

  // Query rows [i0, i0 + rows) of query head `head` and their output-gradient rows as pairs
  // (zero past `rows`), with their log-sum-exp, D_i and visible keys; with `transposed` also
  // packed as the B operands of the key-row products.
  void pair_pack_queries(PairScratch& ps, int64_t b, int64_t head, int64_t i0, int64_t rows,
                         bool transposed) const {
    const Sequence& seq = seqs_[b];
    std::fill(ps.qrows.data(), ps.qrows.data() + kTile * dw_, 0u);
    std::fill(ps.orows.data(), ps.orows.data() + kTile * dwv_, 0u);
    for (int64_t r = 0; r < kTile; ++r) {
      ps.lo[r] = ps.hi[r] = 0;
      ps.lse.data()[r] = kInf;
      ps.delta.data()[r] = 0.0f;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      const int64_t pos = seq.q_begin + i;
      const View& q = p_.q;
      const View& go = p_.dout;
      load_pairs(q, b * q.sb + pos * q.ss + head * q.sn, d_, ps.qrows.data() + r * dw_);
      load_pairs(go, b * go.sb + pos * go.ss + head * go.sn, dv_, ps.orows.data() + r * dwv_);
      ps.delta.data()[r] = delta_[delta_index(b, head, i)];
      ps.lse.data()[r] = p_.lse[b * p_.lse_sb + head * p_.lse_sn + pos * p_.lse_ss];
      const KeyRange vr = visible_keys(mask_, seq, i);
      ps.lo[r] = vr.begin;
      ps.hi[r] = vr.end;
    }
    if (!transposed) return;
    const char* qr[kTile];
    const char* orr[kTile];
    for (int64_t r = 0; r < kTile; ++r) {
      qr[r] = reinterpret_cast<const char*>(ps.qrows.data() + r * dw_);
      orr[r] = reinterpret_cast<const char*>(ps.orows.data() + r * dwv_);
    }
    k_.pack_keys(qr, kTile, dw_, ps.qt.data());
    k_.pack_keys(orr, kTile, dwv_, ps.ot.data());
    interleave_rows(reinterpret_cast<const uint16_t*>(ps.qrows.data()), 2 * dw_, kTile, d_,
                    ps.qi.data(), dp_);
    interleave_rows(reinterpret_cast<const uint16_t*>(ps.orows.data()), 2 * dwv_, kTile, dv_,
                    ps.oi.data(), dvp_);
  }

  // Keys of [a, e) that query row i sees.
  int64_t overlap(const Sequence& seq, int64_t i, int64_t a, int64_t e) const {
    const KeyRange r = visible_keys(mask_, seq, i);
    return std::max<int64_t>(0, std::min(r.end, e) - std::max(r.begin, a));
  }

  Unit unit(int64_t b, int64_t h, int64_t t) const {
    return {static_cast<int32_t>(b), static_cast<int32_t>(h), static_cast<int32_t>(t)};
  }

  // A product of the fused pass in pieces of kAheadRows rows, asking memory for a share of the
  // next tile's rows between them: spread over the products, the requests overlap the
  // arithmetic instead of stalling one copy. Rows are independent, so the bits are the same.
  void gemm_ahead(const KernelSet& set, LinesAhead& ahead, kernels::GemmArgs g) const {
    const int64_t m = g.m;
    for (int64_t r = 0; r < m; r += kAheadRows) {
      ahead.next();
      kernels::GemmArgs piece = g;
      piece.a = static_cast<const uint32_t*>(g.a) + r * g.lda;  // 4-byte words
      piece.c = g.c + r * g.ldc;
      piece.m = std::min(kAheadRows, m - r);
      if (g.row_scale != nullptr) piece.row_scale = g.row_scale + r;
      set.gemm(piece);
    }
  }

  // The query and output-gradient rows of the fused unit's next query tile after (g, t) that
  // sees keys [k0, k0 + nk), for asking memory for them while (g, t) computes; none when the
  // next tile is in another block or the rows are not contiguous.
  RowsAhead next_query_rows(std::vector<const char*>& addresses, const Unit& u, int64_t g,
                            int64_t t, int64_t k0, int64_t nk) const {
    const Sequence& seq = seqs_[u.b];
    const View& q = p_.q;
    const View& go = p_.dout;
    if (q.sd != 1 || go.sd != 1) return {};
    const int64_t tiles = (seq.q_len + kTile - 1) / kTile;
    for (++t; g < group_; ++g, t = 0) {
      for (; t < tiles; ++t) {
        const int64_t i0 = t * kTile;
        const int64_t rows = std::min(kTile, seq.q_len - i0);
        if (!sees_keys(seq, i0, rows, k0, nk)) continue;
        const int64_t head = u.h * group_ + g;
        const char* qb = static_cast<const char*>(q.data);
        const char* ob = static_cast<const char*>(go.data);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t pos = seq.q_begin + i0 + r;
          addresses[2 * r] = qb + (u.b * q.sb + pos * q.ss + head * q.sn) * elem_;
          addresses[2 * r + 1] = ob + (u.b * go.sb + pos * go.ss + head * go.sn) * elem_;
        }
        return {addresses.data(), 2 * rows, std::max(d_, dv_) * elem_};
      }
    }
    return {};
  }

  // Key rows [0, m) of a block of nk keys at k0 that the fused products take for query rows
  // with visible key ends hi[0, rows): up to the last key any of them sees (at least one row).
  static int64_t keys_seen(const int64_t* hi, int64_t rows, int64_t k0, int64_t nk) {
    int64_t last = 0;
    for (int64_t r = 0; r < rows; ++r) last = std::max(last, hi[r]);
    return std::clamp<int64_t>(last - k0, 1, nk);
  }

  // S^T - lse over key rows [0, m) of a block at k0 (columns: the kTile query rows of lse, lo,
  // hi, the first `rows` of them real), -inf where a query row does not see the key. A key every
  // real row sees, in a full tile, takes the plain difference (the same bits: s + -1 lse is
  // s - lse); the others shift_and_mask.
  void shift_key_rows(float* st, int64_t m, int64_t rows, int64_t k0, const float* lse,
                      const int64_t* lo, const int64_t* hi) const {
    int64_t all_lo = 0, all_hi = rows == kTile ? std::numeric_limits<int64_t>::max() : 0;
    for (int64_t r = 0; r < rows; ++r) {
      all_lo = std::max(all_lo, lo[r]);
      all_hi = std::min(all_hi, hi[r]);
    }
    for (int64_t k = 0; k < m; ++k) {
      float* s = st + k * kTile;
      if (k0 + k >= all_lo && k0 + k < all_hi) {
        k_.rows.add_scaled(s, lse, -1.0f, kTile);
      } else {
        k_.rows.shift_and_mask(s, lse, lo, hi, k0 + k);
      }
    }
  }

  // Whether any of query rows [i0, i0 + rows) sees a key of [k0, k0 + keys).
  bool sees_keys(const Sequence& seq, int64_t i0, int64_t rows, int64_t k0, int64_t keys) const {
    bool any = false;
    for (int64_t r = 0; r < rows; ++r) {
      const KeyRange vr = visible_keys(mask_, seq, i0 + r);
      any = any || (vr.end > k0 && vr.begin < k0 + keys && vr.end > vr.begin);
    }
    return any;
  }

  // Key and value rows [k0, k0 + nk) of key head h (zero past nk), and the keys transposed for
  // dQ^T.
  void fused_pack_keys(FusedScratch& fs, int64_t b, int64_t h, int64_t k0, int64_t nk) const {
    const Sequence& seq = seqs_[b];
    std::fill(fs.krows.data(), fs.krows.data() + kBlockKeys * dp_, 0.0f);
    std::fill(fs.vrows.data(), fs.vrows.data() + kBlockKeys * dvp_, 0.0f);
    for (int64_t n = 0; n < nk; ++n) {
      const int64_t key = seq.k_begin + k0 + n;
      const View& k = p_.k;
      const View& v = p_.v;
      load(k.data, b * k.sb + key * k.ss + h * k.sn, k.sd, d_, fs.krows.data() + n * dp_);
      load(v.data, b * v.sb + key * v.ss + h * v.sn, v.sd, dv_, fs.vrows.data() + n * dvp_);
    }
    // K^T [d][256] (zero past nk), once per block: it serves every query tile of the block.
    float* kt = fs.kt.data();
    for (int64_t e = 0; e < d_; ++e) {
      for (int64_t n = 0; n < kBlockKeys; ++n)
        kt[e * kBlockKeys + n] = fs.krows.data()[n * dp_ + e];
    }
  }

  // Query rows [i0, i0 + rows) of query head `head` and their output-gradient rows, each also
  // transposed, with their log-sum-exp, D_i and visible key ranges (empty past `rows`).
  void fused_pack_queries(FusedScratch& fs, int64_t b, int64_t head, int64_t i0,
                          int64_t rows) const {
    const Sequence& seq = seqs_[b];
    std::fill(fs.qrows.data(), fs.qrows.data() + kTile * dp_, 0.0f);
    std::fill(fs.orows.data(), fs.orows.data() + kTile * dvp_, 0.0f);
    const char* qr[kTile];
    const char* orr[kTile];
    for (int64_t r = 0; r < kTile; ++r) {
      qr[r] = reinterpret_cast<const char*>(fs.qrows.data() + r * dp_);
      orr[r] = reinterpret_cast<const char*>(fs.orows.data() + r * dvp_);
      fs.lo[r] = fs.hi[r] = 0;
      fs.lse.data()[r] = kInf;
      fs.delta.data()[r] = 0.0f;
    }
    for (int64_t r = 0; r < rows; ++r) {
      load_query_row(b, head, i0 + r, fs.qrows.data() + r * dp_, fs.orows.data() + r * dvp_,
                     fs.delta.data() + r, fs.lse.data() + r);
      const KeyRange vr = visible_keys(mask_, seq, i0 + r);
      fs.lo[r] = vr.begin;
      fs.hi[r] = vr.end;
    }
    k_.pack_keys(qr, rows, d_, reinterpret_cast<uint32_t*>(fs.qt.data()));
    k_.pack_keys(orr, rows, dv_, reinterpret_cast<uint32_t*>(fs.ot.data()));
  }

  // Widened query rows and output-gradient rows [i0, i0 + rows) of query head `head`, with their
  // log-sum-exp and D_i.
  void pack_queries(Scratch& sc, int64_t b, int64_t head, int64_t i0, int64_t rows) const {
    std::fill(sc.q.data(), sc.q.data() + kTile * dp_, 0.0f);
    std::fill(sc.dout.data(), sc.dout.data() + kTile * dvp_, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      load_query_row(b, head, i0 + r, sc.q.data() + r * dp_, sc.dout.data() + r * dvp_,
                     sc.delta.data() + r, sc.lse.data() + r);
    }
  }

  // Query row i of sequence b and query head `head`, widened, with its output-gradient row,
  // D_i and log-sum-exp.
  void load_query_row(int64_t b, int64_t head, int64_t i, float* q_row, float* dout_row,
                      float* delta, float* lse) const {
    const int64_t pos = seqs_[b].q_begin + i;
    const View& q = p_.q;
    load(q.data, b * q.sb + pos * q.ss + head * q.sn, q.sd, d_, q_row);
    const View& go = p_.dout;
    load(go.data, b * go.sb + pos * go.ss + head * go.sn, go.sd, dv_, dout_row);
    *delta = delta_[delta_index(b, head, i)];
    *lse = p_.lse[b * p_.lse_sb + head * p_.lse_sn + pos * p_.lse_ss];
  }

  // Key tile [k0, k0 + keys) of key head h: transposed keys and values for the two products
  // with 64 columns, and key rows for dQ. Keys past the sequence are zero.
  void pack_keys(Scratch& sc, int64_t b, int64_t h, int64_t k0, int64_t keys, int64_t slot) const {
    const Sequence& seq = seqs_[b];
    float* kt = sc.kt.data() + slot * d_ * kTile;
    float* vt = sc.vt.data() + slot * dv_ * kTile;
    std::fill(kt, kt + d_ * kTile, 0.0f);
    std::fill(vt, vt + dv_ * kTile, 0.0f);
    std::fill(sc.krows.data(), sc.krows.data() + kTile * dp_, 0.0f);
    for (int64_t n = 0; n < keys; ++n) {
      const int64_t key = seq.k_begin + k0 + n;
      const View& k = p_.k;
      const View& v = p_.v;
      float* kr = sc.krows.data() + n * dp_;
      load(k.data, b * k.sb + key * k.ss + h * k.sn, k.sd, d_, kr);
      for (int64_t e = 0; e < d_; ++e) kt[e * kTile + n] = kr[e];
      load(v.data, b * v.sb + key * v.ss + h * v.sn, v.sd, dv_, sc.row.data());
      for (int64_t e = 0; e < dv_; ++e) vt[e * kTile + n] = sc.row.data()[e];
    }
  }

  // For the packed query rows against the packed key tile at k0: P (in sc.dp) and dS (in sc.s),
  // both [rows][64], zero where a key is not visible or past the sequence.
  void probabilities_and_ds(Scratch& sc, const Sequence& seq, int64_t head, int64_t i0,
                            int64_t rows, int64_t k0, int64_t slot) const {
    float* s = sc.s.data();
    float* dp = sc.dp.data();
    k_.gemm({sc.q.data(), dp_, sc.kt.data() + slot * d_ * kTile, kTile, s, kTile, rows, kTile, d_,
             nullptr, p_.softmax_scale});
    k_.gemm({sc.dout.data(), dvp_, sc.vt.data() + slot * dv_ * kTile, kTile, dp, kTile, rows, kTile,
             dv_, nullptr, 1.0f});
    if (mods_) modify_query_rows(s, rows, seq, head, i0, k0, sc.cap.data());
    k_.exp_rows(s, rows, kTile, sc.lse.data());  // P, masked below
    for (int64_t r = 0; r < rows; ++r) {
      const KeyRange vr = visible_keys(mask_, seq, i0 + r);
      const int64_t lo = std::clamp<int64_t>(vr.begin - k0, 0, kTile);
      const int64_t hi = vr.end > vr.begin ? std::clamp<int64_t>(vr.end - k0, 0, kTile) : 0;
      const float lse = sc.lse.data()[r];
      const float delta = sc.delta.data()[r];
      float* sr = s + r * kTile;
      float* dr = dp + r * kTile;
      for (int64_t c = 0; c < kTile; ++c) {
        const float pr = (c >= lo && c < hi && lse != kInf) ? sr[c] : 0.0f;
        sr[c] = pr * (dr[c] - delta);  // dS
        dr[c] = pr;                    // P
      }
      if (p_.softcap > 0.0f) k_.rows.multiply_into(sr, sc.cap.data() + r * kTile);
    }
    for (int64_t r = rows; r < kTile; ++r) {
      std::fill(s + r * kTile, s + (r + 1) * kTile, 0.0f);
      std::fill(dp + r * kTile, dp + (r + 1) * kTile, 0.0f);
    }
  }

  // n elements of a row at element `offset` of `base` with stride sd, widened to float.
  void load(const void* base, int64_t offset, int64_t sd, int64_t n, float* dst) const {
    if (sd == 1) {
      k_.widen(static_cast<const char*>(base) + offset * elem_, p_.dtype, n, dst);
    } else {
      load_row(base, p_.dtype, offset, sd, n, dst);
    }
  }

  // out[c][r] = in[r][c] for r < rows, c < 64.
  static void transpose(const float* in, int64_t rows, float* out) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < kTile; ++c) out[c * rows + r] = in[r * kTile + c];
  }

  const FlashAttnBackwardParams& p_;
  const std::vector<Sequence>& seqs_;
  const KernelSet& k_;   // float32 kernels: the float32 products and every element-wise step
  const KernelSet& kb_;  // the products' kernels: k_, or bf16 pairs for bf16 inputs
  bool pairs_;
  bool mods_;  // softcap or ALiBi
  int64_t group_, d_, dv_, dp_, dvp_;
  int64_t dw_, dwv_;  // pair words per q/k and per v/dout row, padded to kb_'s depth_align
  Mask mask_;
  int64_t elem_;                     // bytes per input element
  std::vector<int64_t> delta_base_;  // first entry of sequence b in delta_
  std::vector<float> delta_;         // D_i for every (sequence, query head, position)

  int64_t delta_index(int64_t b, int64_t head, int64_t i) const {
    return delta_base_[b] + head * seqs_[b].q_len + i;
  }
};

}  // namespace

void validate_backward(const FlashAttnBackwardParams& p, const std::vector<Sequence>& seqs,
                       Isa isa) {
  validate_config(p.config);
  const PlanConfig& c = p.config;
  if (c.layout_kv == Layout::kPagedBBND) {
    throw ArgumentError("layout_kv", "PA_BBND (paged keys and values) has no backward");
  }
  if (static_cast<int64_t>(seqs.size()) != c.batch_size) {
    throw ArgumentError("sequences", "expected " + std::to_string(c.batch_size) +
                                         " (batch_size), got " + std::to_string(seqs.size()));
  }
  // An empty tensor may have no buffer (see validate in flash_attn.cpp): the query side is
  // required when any sequence has queries, the key side when any has queries and keys (key
  // units of sequences without queries are not run; the caller zero-fills the gradients).
  const SequenceWork work = sequence_work(seqs);
  const std::pair<const void*, const char*> query_side[] = {
      {p.q.data, "q"}, {p.out.data, "out"}, {p.dout.data, "dout"},
      {p.lse, "lse"},  {p.dq.data, "dq"},
  };
  const std::pair<const void*, const char*> key_side[] = {
      {p.k.data, "k"}, {p.v.data, "v"}, {p.dk.data, "dk"}, {p.dv.data, "dv"}};
  for (const auto& [ptr, name] : query_side) {
    if (work.queries && ptr == nullptr) throw ArgumentError(name, "is null");
  }
  for (const auto& [ptr, name] : key_side) {
    if (work.pairs && ptr == nullptr) throw ArgumentError(name, "is null");
  }
  if (p.sinks != nullptr && p.dsinks == nullptr) {
    throw ArgumentError("dsinks", "is null but the forward had sinks");
  }
  if (!std::isfinite(p.softmax_scale)) throw ArgumentError("softmax_scale", "must be finite");
  validate_score_mods(c, p.softcap, p.alibi_slopes, p.alibi_sb);
  require_supported(isa);
}

namespace {

// How the backward of a problem runs: 0 for the two passes; otherwise the fused pass, with the
// keys of each (sequence, key head) pair cut into that many chunks. OPMESH_BACKWARD=fused or
// two_pass decides the schedule for the process (tests run both on every case); auto (the default)
// runs fused while a whole pair's dQ accumulator stays within kFusedMaxBytes. Fewer pairs than
// kFusedMinUnits are cut into chunks to make that many units where the keys have the blocks, or
// into fewer where the chunks' accumulators would not fit in kFusedChunkMaxBytes; auto runs the
// two passes when a pair would stay whole. A function of the problem alone, never of the worker
// count, so every plan gives the same bits.
int64_t fused_chunks(const Backward& run) {
  const char* env = std::getenv("OPMESH_BACKWARD");
  const bool forced = env != nullptr && std::strcmp(env, "fused") == 0;
  if (!forced && env != nullptr && *env != '\0' && std::strcmp(env, "auto") != 0) {
    if (std::strcmp(env, "two_pass") == 0) return 0;
    throw ArgumentError("OPMESH_BACKWARD",
                        std::string("expected auto, fused or two_pass, got '") + env + "'");
  }
  const int64_t pairs = run.fused_pairs();
  const int64_t bytes = run.chunk_floats() * static_cast<int64_t>(sizeof(float));
  if (pairs == 0 || pairs >= kFusedMinUnits) return forced || bytes <= kFusedMaxBytes ? 1 : 0;
  // Few pairs: as many chunks as wanted (up to a chunk per key block) whose accumulators fit
  // together, else fewer.
  const int64_t wanted = (kFusedMinUnits + pairs - 1) / pairs;
  for (int64_t chunks = std::min(wanted, run.max_key_blocks()); chunks >= 2; --chunks) {
    const std::vector<int64_t> offsets = run.chunk_offsets(run.fused_units(chunks), chunks);
    if (offsets.back() * static_cast<int64_t>(sizeof(float)) <= kFusedChunkMaxBytes) return chunks;
  }
  return forced ? 1 : 0;
}

// Cuts units (costs in canonical order) into `workers` contiguous ranges: each range ends once
// its cost reaches an equal share of what is left, so no worker starves and none runs long.
void cut(const std::vector<double>& costs, int64_t workers, std::vector<int32_t>& begin,
         std::vector<int32_t>& end, std::vector<float>& worker_cost) {
  double left = 0.0;
  for (double c : costs) left += c;
  int64_t u = 0;
  const int64_t n = static_cast<int64_t>(costs.size());
  for (int64_t w = 0; w < workers; ++w) {
    const double share = left / static_cast<double>(workers - w);
    double acc = 0.0;
    begin.push_back(static_cast<int32_t>(u));
    while (u < n && (w == workers - 1 || acc + 0.5 * costs[u] <= share || acc == 0.0)) {
      acc += costs[u++];
    }
    end.push_back(static_cast<int32_t>(u));
    worker_cost[w] += static_cast<float>(acc);
    left -= acc;
  }
}

}  // namespace

BackwardPlan plan_backward(const PlanConfig& c, const std::vector<Sequence>& seqs) {
  FlashAttnBackwardParams p;
  p.config = c;
  const Backward run(p, seqs, Isa::kScalar);
  BackwardPlan plan;
  const int64_t workers = std::max<int64_t>(1, c.num_workers);
  plan.cost.assign(workers, 0.0f);
  // The mode depends on the problem (and OPMESH_BACKWARD) alone, never on the worker count, so
  // every plan of a call gives the same bits.
  const int64_t chunks = fused_chunks(run);
  plan.fused = chunks > 0;
  const std::vector<Unit> keys = plan.fused ? run.fused_units(chunks) : run.key_units();
  const std::vector<Unit> queries = run.query_units();
  std::vector<double> key_costs, query_costs;
  double largest = 0.0;
  for (const Unit& u : keys) {
    key_costs.push_back(plan.fused ? run.fused_unit_cost(u, chunks) : run.key_unit_cost(u));
  }
  // In fused mode the query units only compute D_i: a row's worth of work each.
  for (const Unit& u : queries) {
    query_costs.push_back(plan.fused ? 1.0 + run.query_rows(u) * kPackNs : run.query_unit_cost(u));
  }
  for (double x : key_costs) largest = std::max(largest, x), plan.total_cost += x;
  for (double x : query_costs) largest = std::max(largest, x), plan.total_cost += x;
  cut(key_costs, workers, plan.key_begin, plan.key_end, plan.cost);
  cut(query_costs, workers, plan.query_begin, plan.query_end, plan.cost);
  plan.num_key_units = static_cast<int64_t>(keys.size());
  plan.num_query_units = static_cast<int64_t>(queries.size());
  for (float x : plan.cost) plan.makespan = std::max(plan.makespan, static_cast<double>(x));
  plan.lower_bound = std::max(plan.total_cost / static_cast<double>(workers), largest);
  return plan;
}

void flash_attn_backward(const FlashAttnBackwardParams& p, const std::vector<Sequence>& seqs,
                         const Executor& executor, Isa isa, const BackwardPlan* given) {
  validate_backward(p, seqs, isa);
  Backward run(p, seqs, isa);
  const int threads = std::max(1, executor.num_workers());
  BackwardPlan own;
  if (given == nullptr) {
    PlanConfig c = p.config;
    c.num_workers = int64_t{4} * threads;  // pulled dynamically, they absorb the model's errors
    own = plan_backward(c, seqs);
  }
  const BackwardPlan& plan = given != nullptr ? *given : own;
  const std::vector<Unit> queries = run.query_units();
  const std::vector<Unit> keys = run.key_units();
  const int64_t chunks = fused_chunks(run);
  const std::vector<Unit> fused = chunks > 0 ? run.fused_units(chunks) : std::vector<Unit>{};
  const int64_t key_count = static_cast<int64_t>(plan.fused ? fused.size() : keys.size());
  if (static_cast<int64_t>(queries.size()) != plan.num_query_units ||
      key_count != plan.num_key_units || plan.fused != (chunks > 0)) {
    throw ArgumentError("metadata", "was planned for other sequences than this call's");
  }
  // Chunked fused units accumulate dQ^T in accumulators of the call, one per unit, in unit order;
  // a pair's chunks are consecutive units.
  AlignedBuffer<float> chunk_dq;
  const std::vector<int64_t> chunk_offsets =
      chunks > 1 ? run.chunk_offsets(fused, chunks) : std::vector<int64_t>{0};
  if (chunks > 1) chunk_dq.grow_uninitialized(chunk_offsets.back());
  auto chunk_dq_of = [&](int64_t i) {
    return chunks > 1 ? chunk_dq.data() + chunk_offsets[i] : nullptr;
  };
  std::vector<std::unique_ptr<Backward::Scratch>> scratch(threads);
  auto scratch_of = [&](int thread) -> Backward::Scratch& {
    if (!scratch[thread]) scratch[thread] = std::make_unique<Backward::Scratch>(run);
    return *scratch[thread];
  };
  std::vector<std::unique_ptr<Backward::FusedScratch>> fused_scratch(threads);
  auto fused_scratch_of = [&](int thread) -> Backward::FusedScratch& {
    if (!fused_scratch[thread]) {
      fused_scratch[thread] =
          std::make_unique<Backward::FusedScratch>(run, chunks == 1 ? run.max_query_tiles() : 0);
    }
    return *fused_scratch[thread];
  };
  const int64_t workers = static_cast<int64_t>(plan.cost.size());
  // D_i (and the sinks' parts) first, since every product reads it; then each worker's units.
  std::vector<double> sink_parts(queries.size(), 0.0);
  run_dynamic(executor, workers, [&](int64_t w, int thread) {
    for (int32_t i = plan.query_begin[w]; i < plan.query_end[w]; ++i) {
      sink_parts[i] = run.deltas(scratch_of(thread), queries[i]);
    }
  });
  if (run.pairs()) {
    std::vector<std::unique_ptr<Backward::PairScratch>> pair_scratch(threads);
    const int64_t tiles = chunks == 1 ? run.max_query_tiles() : 0;
    auto pair_scratch_of = [&](int thread) -> Backward::PairScratch& {
      if (!pair_scratch[thread]) {
        pair_scratch[thread] = std::make_unique<Backward::PairScratch>(run, tiles);
      }
      return *pair_scratch[thread];
    };
    run_dynamic(executor, workers, [&](int64_t w, int thread) {
      const kernels::WorkerScope scope(run.products());
      Backward::PairScratch& ps = pair_scratch_of(thread);
      for (int32_t i = plan.key_begin[w]; i < plan.key_end[w]; ++i) {
        if (plan.fused) {
          run.pair_fused_unit(ps, fused[i], chunks, chunk_dq_of(i));
        } else {
          run.pair_key_unit(ps, keys[i]);
        }
      }
      if (plan.fused) return;
      for (int32_t i = plan.query_begin[w]; i < plan.query_end[w]; ++i) {
        run.pair_query_tile(ps, queries[i]);
      }
    });
  } else if (plan.fused) {
    run_dynamic(executor, workers, [&](int64_t w, int thread) {
      for (int32_t i = plan.key_begin[w]; i < plan.key_end[w]; ++i) {
        run.fused_unit(fused_scratch_of(thread), fused[i], chunks, chunk_dq_of(i));
      }
    });
  } else {
    run_dynamic(executor, workers, [&](int64_t w, int thread) {
      for (int32_t i = plan.key_begin[w]; i < plan.key_end[w]; ++i) {
        run.key_block(scratch_of(thread), keys[i]);
      }
      for (int32_t i = plan.query_begin[w]; i < plan.query_end[w]; ++i) {
        run.query_tile(scratch_of(thread), queries[i]);
      }
    });
  }
  if (chunks > 1) {
    // Each pair's dQ: its chunks' accumulators summed in chunk order.
    std::vector<int64_t> starts;
    for (size_t i = 0; i < fused.size(); ++i) {
      if (i == 0 || fused[i].b != fused[i - 1].b || fused[i].h != fused[i - 1].h) {
        starts.push_back(static_cast<int64_t>(i));
      }
    }
    starts.push_back(static_cast<int64_t>(fused.size()));
    run_dynamic(executor, static_cast<int64_t>(starts.size()) - 1, [&](int64_t j, int) {
      run.store_chunks_dq(fused, starts[j], starts[j + 1] - starts[j], chunks, chunk_dq.data(),
                          chunk_offsets);
    });
  }
  if (p.sinks != nullptr) {
    std::vector<double> total(p.config.num_heads_q, 0.0);
    for (size_t i = 0; i < queries.size(); ++i) total[queries[i].h] += sink_parts[i];
    for (int64_t h = 0; h < p.config.num_heads_q; ++h) {
      p.dsinks[h] = static_cast<float>(-total[h]);
    }
  }
}

}  // namespace opmesh::core::attention
