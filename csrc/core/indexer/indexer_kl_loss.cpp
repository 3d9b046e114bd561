#include "indexer_kl_loss.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#include "../aligned_buffer.h"
#include "../attention/config.h"
#include "../errors.h"
#include "../kernels/kernel_set.h"
#include "../kernels/row_loads.h"
#include "indexer.h"

namespace opmesh::core {
namespace {

using kernels::round_up;

constexpr int64_t kTile = kernels::kKeyTile;  // query positions per query tile, keys per key tile
// Key tiles per unit of the key pass: each query tile it packs serves all of them.
constexpr int64_t kKeyBlock = 4;
constexpr float kInf = std::numeric_limits<float>::infinity();

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

IndexerParams index_params(const IndexerKlLossParams& p) {
  IndexerParams q;
  static_cast<Compression&>(q) = p;
  q.layout = p.layout;
  q.sparse_mode = p.sparse_mode;
  q.pre_tokens = p.pre_tokens;
  q.next_tokens = p.next_tokens;
  q.batch = p.batch;
  q.seq_q = p.seq_q;
  q.seq_k = p.seq_k;
  q.heads_q = p.index_heads_q;
  q.heads_k = p.index_heads_k;
  q.head_dim = p.index_dim;
  q.qk_dtype = p.query_index.dtype;
  q.weights_dtype = p.weights.dtype;
  q.seq_q_lens = p.seq_q_lens;
  q.seq_k_lens = p.seq_k_lens;
  return q;
}

namespace {

// A unit of one pass: sequence b, tile t (query positions in pass 1, keys in pass 2).
struct Unit {
  int32_t b, t;
  double cost;  // visible (query, key) pairs, for the order in which tasks are handed out
};

class KlLoss {
 public:
  KlLoss(const IndexerKlLossParams& p, Isa isa)
      : p_(p),
        k_(kernels::float32_set(isa)),
        kb_(kernels::select_set(isa, score_dtype(p), -1, true)),
        pairs_(kb_.word == kernels::Word::kBf16Pair),
        mask_(compressed(indexer_mask(p.sparse_mode, p.pre_tokens, p.next_tokens), p)),
        seqs_(indexer_sequences(index_params(p))),
        group_(p.heads_q / p.heads_k),
        igroup_(p.index_heads_q / p.index_heads_k),
        dm_(p.head_dim + p.rope_dim),
        dmp_(round_up(dm_, 16)),
        di_(p.index_dim),
        dip_(round_up(di_, 16)),
        dmw_(round_up((dm_ + 1) / 2, kb_.depth_align)),
        diw_(round_up((di_ + 1) / 2, kb_.depth_align)),
        di16_(round_up(di_, 16)) {
    int64_t total = 0;
    for (const Sequence& s : seqs_) {
      z_base_.push_back(total);
      total += s.q_len;
    }
    z_.assign(total, 0.0f);
  }

  struct Scratch {
    explicit Scratch(const KlLoss& r)
        : mq(r.p_.heads_q * kTile * r.dmp_),
          mk(r.p_.heads_k * r.dm_ * kTile),
          qi(r.p_.index_heads_q * kTile * r.dip_),
          kit(r.p_.index_heads_k * r.di_ * kTile),
          kir(r.p_.index_heads_k * kTile * r.dip_),
          qit(r.p_.index_heads_q * r.di_ * kTile),
          w(kTile * r.p_.index_heads_q),
          shift(r.p_.heads_q * kTile),
          ishift(r.p_.index_heads_k * kTile),
          s(r.group_ * kTile * kTile),
          prob(kTile * kTile),
          si(r.igroup_ * kTile * kTile),
          score(kTile * kTile),
          coef(2 * kTile * r.igroup_ * kTile),
          acc(std::max(r.p_.index_heads_q * 2 * kTile * r.dip_,
                       kKeyBlock * r.p_.index_heads_k * r.di_ * kTile)),
          row(std::max({r.dmp_, r.dip_, kTile})),
          ones(2 * kTile * r.igroup_),
          dw(2 * kTile * r.p_.index_heads_q),
          stats((2 + r.p_.index_heads_k) * kTile),
          mqp(r.pairs_ ? r.p_.heads_q * kTile * r.dmw_ : 0),
          mkp(r.pairs_ ? r.p_.heads_k * r.dmw_ * kTile : 0),
          qip(r.pairs_ ? r.p_.index_heads_q * kTile * r.diw_ : 0),
          kitp(r.pairs_ ? r.p_.index_heads_k * r.diw_ * kTile : 0),
          krow(r.pairs_ ? std::max(kTile * std::max(r.dmw_, r.diw_), kTile / 2 * r.dip_) : 0),
          kirp(r.pairs_ ? r.p_.index_heads_k * kTile * r.dip_ : 0),
          qitp(r.pairs_ ? r.p_.index_heads_q * r.di16_ * kTile : 0),
          coef16(r.pairs_ ? (r.igroup_ * 2 * kTile + 16) * 2 * kTile : 0),
          coefp(r.pairs_ ? kTile * kTile : 0),
          lo(r.pairs_ ? kTile * kTile : 0) {
      std::fill(ones.data(), ones.data() + 2 * kTile * r.igroup_, 1.0f);
    }
    AlignedBuffer<float> mq;      // [N1][64][dmp] main query rows (query and rope parts)
    AlignedBuffer<float> mk;      // [N2][dm][64] main keys, transposed
    AlignedBuffer<float> qi;      // [N1index][64][dip] index query rows, zero-padded
    AlignedBuffer<float> kit;     // [N2index][di][64] index keys, transposed
    AlignedBuffer<float> kir;     // [N2index][64][dip] index key rows
    AlignedBuffer<float> qit;     // [N1index][di][64] index query rows, transposed (key pass)
    AlignedBuffer<float> w;       // [64][N1index] weights
    AlignedBuffer<float> shift;   // [N1][64] the main log-sum-exp (+inf: the row has no mass)
    AlignedBuffer<float> ishift;  // [N2index][64] the indexer's log-sum-exp
    AlignedBuffer<float> s;       // [G][64][64] the scores of one main key head's query heads
    AlignedBuffer<float> prob;    // [64][64] P, the head-summed main probabilities
    AlignedBuffer<float> si;      // [group][64][64] index scores of one key head's query heads
    AlignedBuffer<float> score;   // [64][64] I, then the indexer's softmax, then dI
    AlignedBuffer<float> coef;    // products' left operands
    AlignedBuffer<float> acc;     // pass 1: [N1index][2][64][dip]; pass 2: [4][N2index][di][64]
    AlignedBuffer<float> row;
    AlignedBuffer<float> ones;
    std::vector<double> dw;     // [2][64][N1index] the two parts of d_weights
    std::vector<double> stats;  // Z, sum P log P, and per index key head sum P I: [2 + N2i][64]
    // bf16 inputs on pair kernels: the two score products' operands as bf16 pairs.
    AlignedBuffer<uint32_t> mqp;   // [N1][64][dmw] main query rows (query, then rope)
    AlignedBuffer<uint32_t> mkp;   // [N2][dmw][64] main keys, packed
    AlignedBuffer<uint32_t> qip;   // [N1index][64][diw] index query rows
    AlignedBuffer<uint32_t> kitp;  // [N2index][diw][64] index keys, packed
    AlignedBuffer<uint32_t> krow;  // [64][words] key rows before packing (or [32][dip] pairs)
    // The two gradient products on pairs. Their left or right operand is a float32 coefficient
    // c, carried as bf16(c) and bf16(c - bf16(c)) side by side along the depth against the
    // other operand twice: float32's accuracy in one product of twice the depth.
    AlignedBuffer<uint32_t> kirp;    // [N2index][64][dip]: key pairs of index keys, then again
    AlignedBuffer<uint32_t> qitp;    // [N1index][di16][64]: query-row pairs, then again
    AlignedBuffer<uint16_t> coef16;  // [coef rows (+16)][128]: 64 bf16(c), then 64 bf16(lo)
    AlignedBuffer<uint32_t> coefp;   // [64][64]: coef's query-row pairs (32 rows), then lo's
    AlignedBuffer<float> lo;         // [64][64] c - bf16(c) of one head's coefficients
  };

  const kernels::KernelSet& products() const { return kb_; }

  std::vector<Unit> units(bool queries) const {
    std::vector<Unit> out;
    for (int64_t b = 0; b < static_cast<int64_t>(seqs_.size()); ++b) {
      const Sequence& seq = seqs_[b];
      const int64_t len = queries ? seq.q_len : seq.k_len;
      if (seq.q_len == 0 || seq.k_len == 0) continue;
      // Query units are tiles; key units are blocks of kKeyBlock tiles (a query tile packed
      // once serves the whole block).
      const int64_t step = queries ? kTile : kKeyBlock * kTile;
      for (int64_t t = 0; t * step < len; ++t) {
        double cost = 0.0;
        if (queries) {
          for (int64_t i = t * kTile; i < std::min(len, (t + 1) * kTile); ++i) {
            const KeyRange r = visible_keys(mask_, seq, i);
            cost += static_cast<double>(r.end - r.begin);
          }
        } else {
          for (int64_t k0 = t * step; k0 < std::min(len, (t + 1) * step); k0 += kTile) {
            const int64_t k1 = k0 + kTile;
            if (!key_tile_seen(seq, k0, k1)) continue;
            // Per query tile, its first and last rows' overlap with the key tile (both ends
            // of the visible ranges grow with the row): O(query tiles), not O(rows).
            auto seen = [&](int64_t i) {
              const KeyRange r = visible_keys(mask_, seq, i);
              return static_cast<double>(
                  std::max<int64_t>(0, std::min(r.end, k1) - std::max(r.begin, k0)));
            };
            for (int64_t i0 = 0; i0 < seq.q_len; i0 += kTile) {
              const int64_t last = std::min(seq.q_len, i0 + kTile) - 1;
              cost += 0.5 * static_cast<double>(last - i0 + 1) * (seen(i0) + seen(last)) + 1.0;
            }
          }
        }
        if (cost > 0) out.push_back({static_cast<int32_t>(b), static_cast<int32_t>(t), cost});
      }
    }
    return out;
  }

  // Whether any query row of seq sees a key of [k0, k1). Both ends of the visible ranges are
  // non-decreasing in the row (rows that see nothing, {0, 0}, come first): the first row whose
  // range ends after k0 has the smallest start among those that might overlap.
  bool key_tile_seen(const Sequence& seq, int64_t k0, int64_t k1) const {
    int64_t lo = 0, hi = seq.q_len;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (visible_keys(mask_, seq, mid).end > k0) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    if (lo == seq.q_len) return false;
    const KeyRange r = visible_keys(mask_, seq, lo);
    return r.end > r.begin && r.begin < k1;
  }

  // Pass 1: query tile u.t of sequence u.b against every key tile it sees. Writes the tile's
  // d_query_index and d_weights rows and its Z; returns its share of the loss.
  double query_tile(Scratch& sc, const Unit& u) {
    const Sequence& seq = seqs_[u.b];
    const int64_t i0 = u.t * kTile;
    const int64_t rows = std::min(kTile, seq.q_len - i0);
    const int64_t n1i = p_.index_heads_q, n2i = p_.index_heads_k;
    pack_queries(sc, u.b, i0, rows);
    std::fill(sc.acc.data(), sc.acc.data() + n1i * 2 * kTile * dip_, 0.0f);
    std::fill(sc.dw.begin(), sc.dw.end(), 0.0);
    std::fill(sc.stats.begin(), sc.stats.end(), 0.0);
    double* z = sc.stats.data();
    double* plogp = z + kTile;
    double* pi = plogp + kTile;  // [N2index][64]
    const KeyRange span = key_span(seq, i0, rows);
    for (int64_t k0 = span.begin / kTile * kTile; k0 < span.end; k0 += kTile) {
      pack_keys(sc, u.b, k0, std::min(kTile, seq.k_len - k0));
      target(sc, seq, i0, rows, k0);
      const float* prob = sc.prob.data();
      k_.rows.entropy_terms(prob, rows, z, plogp);
      for (int64_t g = 0; g < n2i; ++g) {
        index_scores(sc, seq, g, i0, rows, k0);
        const float* score = sc.score.data();  // I, before the softmax below
        k_.rows.row_dots(prob, score, rows, pi + g * kTile);
        index_softmax(sc, seq, g, i0, rows, k0);
        // Per query head of the group: the indexer's part (rows 0..63 of the head's block of
        // coef) and the target's part (rows 64..127) of d_query_index, accumulated apart until
        // Z is known; one product for the whole group.
        double* dw1 = sc.dw.data();
        double* dw2 = dw1 + kTile * n1i;
        for (int64_t hl = 0; hl < igroup_; ++hl) {
          const int64_t h = g * igroup_ + hl;
          const float* sh = sc.si.data() + hl * kTile * kTile;
          float* c1 = sc.coef.data() + hl * 2 * kTile * kTile;
          float* c2 = c1 + kTile * kTile;
          for (int64_t r = 0; r < kTile; ++r) {
            const float wr = r < rows ? sc.w.data()[r * n1i + h] : 0.0f;
            float a1 = 0.0f, a2 = 0.0f;
            k_.rows.split_coefficients(sh + r * kTile, score + r * kTile, prob + r * kTile, wr,
                                       c1 + r * kTile, c2 + r * kTile, &a1, &a2);
            if (r < rows) {
              dw1[r * n1i + h] += a1;
              dw2[r * n1i + h] += a2;
            }
          }
        }
        float* acc = sc.acc.data() + g * igroup_ * 2 * kTile * dip_;
        if (pairs_) {
          const int64_t n = igroup_ * 2 * kTile;
          for (int64_t r = 0; r < n; ++r) {
            const float* c = sc.coef.data() + r * kTile;
            uint16_t* row = sc.coef16.data() + r * 2 * kTile;
            float* lo = sc.lo.data();
            kb_.to_bf16(c, row, kTile);
            kb_.rows.bf16_residual(c, lo);
            kb_.to_bf16(lo, row + kTile, kTile);
          }
          kb_.gemm({sc.coef16.data(), kTile, sc.kirp.data() + g * kTile * dip_, dip_, acc, dip_, n,
                    dip_, kTile, sc.ones.data(), 1.0f});
        } else {
          k_.gemm({sc.coef.data(), kTile, sc.kir.data() + g * kTile * dip_, dip_, acc, dip_,
                   igroup_ * 2 * kTile, dip_, kTile, sc.ones.data(), 1.0f});
        }
      }
    }
    // Combine the parts now that Z is known, and write the tile's rows.
    double loss = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      const float zr = static_cast<float>(z[r]);
      z_[z_base_[u.b] + i0 + r] = zr;
      const float inv = zr > 0.0f ? 1.0f / zr : 0.0f;
      const int64_t pos = seq.q_begin + i0 + r;
      for (int64_t h = 0; h < n1i; ++h) {
        float* a = sc.acc.data() + h * 2 * kTile * dip_;
        float* out = sc.row.data();
        for (int64_t e = 0; e < di_; ++e) {
          out[e] = zr > 0.0f ? a[r * dip_ + e] - a[(kTile + r) * dip_ + e] * inv : 0.0f;
        }
        const KlGradient& dq = p_.d_query_index;
        store_row(k_, dq.data, dq.dtype, offset(dq, u.b, pos, h), dq.sd, di_, out, 1.0f);
        const double* dw1 = sc.dw.data();
        const double* dw2 = dw1 + kTile * n1i;
        const float dw =
            zr > 0.0f ? static_cast<float>(dw1[r * n1i + h] - dw2[r * n1i + h] / z[r]) : 0.0f;
        const KlGradient& gw = p_.d_weights;
        store_row(k_, gw.data, gw.dtype, offset(gw, u.b, pos, h), 1, 1, &dw, 1.0f);
      }
      if (zr > 0.0f) {
        for (int64_t g = 0; g < n2i; ++g) {
          // KL(phat || q) = sum_j phat (log phat - I + lse_index)
          //              = (sum P log P - sum P I) / Z - log Z + lse_index.
          const double lse = sc.ishift.data()[g * kTile + r];
          loss += (plogp[r] - pi[g * kTile + r]) / z[r] - std::log(z[r]) + lse;
        }
      }
    }
    return loss;
  }

  // Pass 2: key tiles [first, first + 4 * 64) of block u.t of sequence u.b against every query
  // tile that sees them (each query tile packed once for the block); writes their d_key_index
  // rows. Needs Z from pass 1.
  void key_block(Scratch& sc, const Unit& u) const {
    const Sequence& seq = seqs_[u.b];
    const int64_t first = u.t * kKeyBlock * kTile;
    const int64_t last = std::min(seq.k_len, first + kKeyBlock * kTile);
    const int64_t n2i = p_.index_heads_k;
    // d_key_index transposed, [tile][N2index][di][64]: each product adds one query head's share.
    std::fill(sc.acc.data(), sc.acc.data() + kKeyBlock * n2i * di_ * kTile, 0.0f);
    for (int64_t i0 = 0; i0 < seq.q_len; i0 += kTile) {
      const int64_t rows = std::min(kTile, seq.q_len - i0);
      const KeyRange span = key_span(seq, i0, rows);
      if (span.end <= first || span.begin >= last) continue;
      pack_queries(sc, u.b, i0, rows);
      transpose_index_queries(sc);
      for (int64_t k0 = first; k0 < last; k0 += kTile) {
        const int64_t keys = std::min(kTile, seq.k_len - k0);
        if (span.end <= k0 || span.begin >= k0 + keys) continue;
        pack_keys(sc, u.b, k0, keys);
        key_tile_against(sc, seq, u.b, i0, rows, k0,
                         sc.acc.data() + (k0 - first) / kTile * n2i * di_ * kTile);
      }
    }
    for (int64_t k0 = first; k0 < last; k0 += kTile) {
      const float* acc = sc.acc.data() + (k0 - first) / kTile * n2i * di_ * kTile;
      for (int64_t n = 0; n < std::min(kTile, seq.k_len - k0); ++n) {
        const int64_t key = seq.k_begin + k0 + n;
        for (int64_t g = 0; g < n2i; ++g) {
          const KlGradient& dk = p_.d_key_index;
          float* row = sc.row.data();
          const float* col = acc + g * di_ * kTile + n;
          for (int64_t e = 0; e < di_; ++e) row[e] = col[e * kTile];
          store_row(k_, dk.data, dk.dtype, offset(dk, u.b, key, g), dk.sd, di_, row, 1.0f);
        }
      }
    }
  }

  // The packed query tile at i0 against the packed key tile at k0: adds the tile's share of
  // d_key_index^T into acc ([N2index][di][64]).
  void key_tile_against(Scratch& sc, const Sequence& seq, int64_t b, int64_t i0, int64_t rows,
                        int64_t k0, float* acc) const {
    const int64_t n2i = p_.index_heads_k;
    target(sc, seq, i0, rows, k0);
    for (int64_t g = 0; g < n2i; ++g) {
      index_scores(sc, seq, g, i0, rows, k0);
      index_softmax(sc, seq, g, i0, rows, k0);
      // dI = q - P / Z in sc.score.
      float* di = sc.score.data();
      for (int64_t r = 0; r < rows; ++r) {
        const float zr = z_[z_base_[b] + i0 + r];
        const float inv = zr > 0.0f ? 1.0f / zr : 0.0f;
        const float keep = zr > 0.0f ? 1.0f : 0.0f;
        k_.rows.target_gradient(di + r * kTile, sc.prob.data() + r * kTile, inv, keep);
      }
      // Per query head of the group: coef = dI w [S > 0] ([64 rows][64 keys]), and
      // d_key_index^T += query_index^T coef.
      for (int64_t hl = 0; hl < igroup_; ++hl) {
        const int64_t h = g * igroup_ + hl;
        const float* sh = sc.si.data() + hl * kTile * kTile;
        float* coef = sc.coef.data() + hl * kTile * kTile;
        for (int64_t r = 0; r < kTile; ++r) {
          const float wr = r < rows ? sc.w.data()[r * p_.index_heads_q + h] : 0.0f;
          k_.rows.masked_scale(sh + r * kTile, di + r * kTile, wr, coef + r * kTile);
        }
        if (pairs_) {
          // coefp rows l < 32: (coef[2l], coef[2l + 1]); rows 32 + l: the same of lo.
          float* lo = sc.lo.data();
          for (int64_t r = 0; r < kTile; ++r) {
            kb_.rows.bf16_residual(coef + r * kTile, lo + r * kTile);
          }
          uint32_t* cp = sc.coefp.data();
          for (int64_t l = 0; l < kTile / 2; ++l) {
            kb_.rows.pair_rows(coef + 2 * l * kTile, coef + (2 * l + 1) * kTile, cp + l * kTile);
            kb_.rows.pair_rows(lo + 2 * l * kTile, lo + (2 * l + 1) * kTile,
                               cp + (kTile / 2 + l) * kTile);
          }
          kb_.gemm({sc.qitp.data() + h * di16_ * kTile, kTile, cp, kTile, acc + g * di_ * kTile,
                    kTile, di_, kTile, kTile, sc.ones.data(), 1.0f});
        } else {
          k_.gemm({sc.qit.data() + h * di_ * kTile, kTile, coef, kTile, acc + g * di_ * kTile,
                   kTile, di_, kTile, kTile, sc.ones.data(), 1.0f});
        }
      }
    }
  }

 private:
  template <class V>  // View or MutableView
  int64_t offset(const V& v, int64_t b, int64_t token, int64_t head) const {
    return (p_.layout == Layout::kBSND ? b * v.sb : 0) + token * v.ss + head * v.sn;
  }

  void load(const KlOperand& t, int64_t b, int64_t token, int64_t head, int64_t n,
            float* dst) const {
    const int64_t off = offset(t, b, token, head);
    if (t.sd == 1) {
      const int64_t elem = t.dtype == DType::kFloat64 ? 8 : t.dtype == DType::kFloat32 ? 4 : 2;
      k_.widen(static_cast<const char*>(t.data) + off * elem, t.dtype, n, dst);
    } else {
      load_row(t.data, t.dtype, off, t.sd, n, dst);
    }
  }

  // The index query rows of every head transposed, [N1index][di][64] (sc.qit), for the key
  // pass's d_key_index^T product.
  void transpose_index_queries(Scratch& sc) const {
    const char* rows[kTile];
    if (pairs_) {
      // qitp[h][e][l] = qitp[h][e][32 + l] = (qi[h][2l][e], qi[h][2l + 1][e]), through the query
      // rows paired in sc.krow ([32][dip] words) and the key packing's transpose.
      uint32_t* paired = sc.krow.data();
      for (int64_t l = 0; l < kTile / 2; ++l) {
        rows[l] = rows[kTile / 2 + l] = reinterpret_cast<const char*>(paired + l * dip_);
      }
      for (int64_t h = 0; h < p_.index_heads_q; ++h) {
        const uint16_t* q16 = reinterpret_cast<const uint16_t*>(sc.qip.data() + h * kTile * diw_);
        for (int64_t l = 0; l < kTile / 2; ++l) {
          kb_.rows.interleave_bf16(q16 + 2 * l * 2 * diw_, q16 + (2 * l + 1) * 2 * diw_, di_,
                                   paired + l * dip_);
        }
        kb_.pack_keys(rows, kTile, di_, sc.qitp.data() + h * di16_ * kTile);
      }
      return;
    }
    for (int64_t h = 0; h < p_.index_heads_q; ++h) {
      for (int64_t r = 0; r < kTile; ++r) {
        rows[r] = reinterpret_cast<const char*>(sc.qi.data() + (h * kTile + r) * dip_);
      }
      k_.pack_keys(rows, kTile, di_, reinterpret_cast<uint32_t*>(sc.qit.data() + h * di_ * kTile));
    }
  }

  // n bf16 elements of a row, as they are (the pair kernels' operands).
  void load_bf16(const KlOperand& t, int64_t b, int64_t token, int64_t head, int64_t n,
                 uint16_t* dst) const {
    const uint16_t* src = static_cast<const uint16_t*>(t.data) + offset(t, b, token, head);
    if (t.sd == 1) {
      std::memcpy(dst, src, n * sizeof(uint16_t));
    } else {
      for (int64_t e = 0; e < n; ++e) dst[e] = src[e * t.sd];
    }
  }

  // Key tile [k0, k0 + keys) of both attentions' keys as packed bf16 pairs (zero past `keys`).
  void pack_key_pairs(Scratch& sc, int64_t b, int64_t k0, int64_t keys) const {
    const Sequence& seq = seqs_[b];
    const char* rows[kTile];
    auto pack = [&](int64_t words, uint32_t* out, auto&& fill_row) {
      std::fill(sc.krow.data(), sc.krow.data() + kTile * words, 0u);
      for (int64_t n = 0; n < keys; ++n) {
        uint32_t* row = sc.krow.data() + n * words;
        fill_row(seq.k_begin + k0 + n, reinterpret_cast<uint16_t*>(row));
        rows[n] = reinterpret_cast<const char*>(row);
      }
      kb_.pack_keys(rows, keys, words, out);
    };
    for (int64_t h = 0; h < p_.heads_k; ++h) {
      pack(dmw_, sc.mkp.data() + h * dmw_ * kTile, [&](int64_t key, uint16_t* row) {
        load_bf16(p_.key, b, key, h, p_.head_dim, row);
        if (p_.rope_dim > 0) load_bf16(p_.key_rope, b, key, h, p_.rope_dim, row + p_.head_dim);
      });
    }
    for (int64_t g = 0; g < p_.index_heads_k; ++g) {
      pack(diw_, sc.kitp.data() + g * diw_ * kTile,
           [&](int64_t key, uint16_t* row) { load_bf16(p_.key_index, b, key, g, di_, row); });
      // kirp[g][l] = kirp[g][32 + l] = (k[2l], k[2l + 1]) from the rows still in sc.krow.
      const uint16_t* k16 = reinterpret_cast<const uint16_t*>(sc.krow.data());
      uint32_t* out = sc.kirp.data() + g * kTile * dip_;
      for (int64_t l = 0; l < kTile / 2; ++l) {
        kb_.rows.interleave_bf16(k16 + 2 * l * 2 * diw_, k16 + (2 * l + 1) * 2 * diw_, di_,
                                 out + l * dip_);
      }
      std::memcpy(out + kTile / 2 * dip_, out, kTile / 2 * dip_ * sizeof(uint32_t));
    }
  }

  // The union of the keys rows [i0, i0 + rows) see; empty when none sees any.
  KeyRange key_span(const Sequence& seq, int64_t i0, int64_t rows) const {
    KeyRange span{seq.k_len, 0};
    for (int64_t r = 0; r < rows; ++r) {
      const KeyRange v = visible_keys(mask_, seq, i0 + r);
      if (v.end > v.begin) {
        span.begin = std::min(span.begin, v.begin);
        span.end = std::max(span.end, v.end);
      }
    }
    if (span.end <= span.begin) return {0, 0};
    return span;
  }

  // Query rows [i0, i0 + rows) of sequence b: main queries (with rope), index queries, weights
  // and both log-sum-exps; rows past `rows` are zero.
  void pack_queries(Scratch& sc, int64_t b, int64_t i0, int64_t rows) const {
    const Sequence& seq = seqs_[b];
    if (pairs_) {
      std::fill(sc.mqp.data(), sc.mqp.data() + p_.heads_q * kTile * dmw_, 0u);
      std::fill(sc.qip.data(), sc.qip.data() + p_.index_heads_q * kTile * diw_, 0u);
    } else {
      std::fill(sc.mq.data(), sc.mq.data() + p_.heads_q * kTile * dmp_, 0.0f);
    }
    std::fill(sc.qi.data(), sc.qi.data() + p_.index_heads_q * kTile * dip_, 0.0f);
    std::fill(sc.w.data(), sc.w.data() + kTile * p_.index_heads_q, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = seq.q_begin + i0 + r;
      const int64_t srow = i0 + r + (p_.layout == Layout::kTND ? seq.q_begin : 0);
      for (int64_t h = 0; h < p_.heads_q; ++h) {
        if (pairs_) {
          uint16_t* dst = reinterpret_cast<uint16_t*>(sc.mqp.data() + (h * kTile + r) * dmw_);
          load_bf16(p_.query, b, pos, h, p_.head_dim, dst);
          if (p_.rope_dim > 0) load_bf16(p_.query_rope, b, pos, h, p_.rope_dim, dst + p_.head_dim);
        } else {
          float* dst = sc.mq.data() + (h * kTile + r) * dmp_;
          load(p_.query, b, pos, h, p_.head_dim, dst);
          if (p_.rope_dim > 0) load(p_.query_rope, b, pos, h, p_.rope_dim, dst + p_.head_dim);
        }
        // The main statistics: [B, N2, S1, G] / [N2, T1, G].
        const int64_t n2 = h / group_, gg = h % group_;
        const int64_t at = ((p_.layout == Layout::kBSND ? b * p_.heads_k : 0) + n2) * p_.seq_q;
        const int64_t idx = (at + srow) * group_ + gg;
        const float m = p_.softmax_max[idx];
        const float l = p_.softmax_sum[idx];
        // A log-sum-exp of -inf (a max of -inf, or no positive sum): no target mass (+inf).
        sc.shift.data()[h * kTile + r] = m != -kInf && l > 0.0f ? m + std::log(l) : kInf;
      }
      for (int64_t h = 0; h < p_.index_heads_q; ++h) {
        load(p_.query_index, b, pos, h, di_, sc.qi.data() + (h * kTile + r) * dip_);
        if (pairs_) {
          load_bf16(p_.query_index, b, pos, h, di_,
                    reinterpret_cast<uint16_t*>(sc.qip.data() + (h * kTile + r) * diw_));
        }
        const int64_t off = offset(p_.weights, b, pos, h);
        load_row(p_.weights.data, p_.weights.dtype, off, 1, 1,
                 sc.w.data() + r * p_.index_heads_q + h);
      }
      for (int64_t g = 0; g < p_.index_heads_k; ++g) {
        const int64_t at = ((p_.layout == Layout::kBSND ? b * p_.index_heads_k : 0) + g) * p_.seq_q;
        const float m = p_.softmax_max_index[at + srow];
        const float l = p_.softmax_sum_index[at + srow];
        sc.ishift.data()[g * kTile + r] = l > 0.0f ? m + std::log(l) : kInf;
      }
    }
  }

  // Key tile [k0, k0 + keys) of sequence b, every key head of both attentions; keys past the
  // tile's end are zero.
  void pack_keys(Scratch& sc, int64_t b, int64_t k0, int64_t keys) const {
    const Sequence& seq = seqs_[b];
    if (!pairs_) std::fill(sc.mk.data(), sc.mk.data() + p_.heads_k * dm_ * kTile, 0.0f);
    std::fill(sc.kit.data(), sc.kit.data() + p_.index_heads_k * di_ * kTile, 0.0f);
    std::fill(sc.kir.data(), sc.kir.data() + p_.index_heads_k * kTile * dip_, 0.0f);
    if (pairs_) pack_key_pairs(sc, b, k0, keys);
    float* row = sc.row.data();
    for (int64_t n = 0; n < keys; ++n) {
      const int64_t key = seq.k_begin + k0 + n;
      for (int64_t h = 0; h < p_.heads_k && !pairs_; ++h) {
        load(p_.key, b, key, h, p_.head_dim, row);
        if (p_.rope_dim > 0) load(p_.key_rope, b, key, h, p_.rope_dim, row + p_.head_dim);
        float* kt = sc.mk.data() + h * dm_ * kTile;
        for (int64_t e = 0; e < dm_; ++e) kt[e * kTile + n] = row[e];
      }
      for (int64_t g = 0; g < p_.index_heads_k; ++g) {
        float* kr = sc.kir.data() + (g * kTile + n) * dip_;
        load(p_.key_index, b, key, g, di_, kr);
        float* kt = sc.kit.data() + g * di_ * kTile;
        for (int64_t e = 0; e < di_; ++e) kt[e * kTile + n] = kr[e];
      }
    }
  }

  // P = sum over main query heads of their probabilities, [64][64] in sc.prob, zero where a key
  // is not visible (or past the sequence) and on rows past `rows`.
  void target(Scratch& sc, const Sequence& seq, int64_t i0, int64_t rows, int64_t k0) const {
    float* prob = sc.prob.data();
    float* s = sc.s.data();
    std::fill(prob, prob + kTile * kTile, 0.0f);
    // The G query heads of a key head are consecutive 64-row blocks of mq: one product each.
    // Rows past `rows` are zero queries; whatever they give is masked below.
    for (int64_t n2 = 0; n2 < p_.heads_k; ++n2) {
      if (pairs_) {
        kb_.gemm({sc.mqp.data() + n2 * group_ * kTile * dmw_, dmw_,
                  sc.mkp.data() + n2 * dmw_ * kTile, kTile, s, kTile, group_ * kTile, kTile, dmw_,
                  nullptr, p_.scale});
      } else {
        k_.gemm({sc.mq.data() + n2 * group_ * kTile * dmp_, dmp_, sc.mk.data() + n2 * dm_ * kTile,
                 kTile, s, kTile, group_ * kTile, kTile, dm_, nullptr, p_.scale});
      }
      k_.exp_rows(s, group_ * kTile, kTile, sc.shift.data() + n2 * group_ * kTile);
      for (int64_t h = 0; h < group_; ++h)
        k_.rows.add_into(prob, s + h * kTile * kTile, rows * kTile);
    }
    apply_mask(prob, seq, i0, rows, k0);
  }

  // The index scores of key head g's query heads (sc.si, raw dot products) and I (sc.score),
  // masked to 0 where not visible.
  void index_scores(Scratch& sc, const Sequence& seq, int64_t g, int64_t i0, int64_t rows,
                    int64_t k0) const {
    float* score = sc.score.data();
    std::fill(score, score + kTile * kTile, 0.0f);
    if (pairs_) {
      kb_.gemm({sc.qip.data() + g * igroup_ * kTile * diw_, diw_, sc.kitp.data() + g * diw_ * kTile,
                kTile, sc.si.data(), kTile, igroup_ * kTile, kTile, diw_, nullptr, 1.0f});
    } else {
      k_.gemm({sc.qi.data() + g * igroup_ * kTile * dip_, dip_, sc.kit.data() + g * di_ * kTile,
               kTile, sc.si.data(), kTile, igroup_ * kTile, kTile, di_, nullptr, 1.0f});
    }
    for (int64_t hl = 0; hl < igroup_; ++hl) {
      const int64_t h = g * igroup_ + hl;
      const float* sh = sc.si.data() + hl * kTile * kTile;
      for (int64_t r = 0; r < rows; ++r) {
        k_.rows.relu_axpy(sc.w.data()[r * p_.index_heads_q + h], sh + r * kTile, score + r * kTile);
      }
    }
    apply_mask(score, seq, i0, rows, k0);
  }

  // sc.score <- the indexer's softmax exp(I - lse_index), 0 where not visible.
  void index_softmax(Scratch& sc, const Sequence& seq, int64_t g, int64_t i0, int64_t rows,
                     int64_t k0) const {
    k_.exp_rows(sc.score.data(), rows, kTile, sc.ishift.data() + g * kTile);
    apply_mask(sc.score.data(), seq, i0, rows, k0);
  }

  // Zeroes the entries of a [64][64] tile that query rows [i0, i0 + rows) do not see, and rows
  // past `rows`.
  void apply_mask(float* tile, const Sequence& seq, int64_t i0, int64_t rows, int64_t k0) const {
    for (int64_t r = 0; r < kTile; ++r) {
      float* t = tile + r * kTile;
      if (r >= rows) {
        std::fill(t, t + kTile, 0.0f);
        continue;
      }
      const KeyRange v = visible_keys(mask_, seq, i0 + r);
      const int64_t lo = std::clamp<int64_t>(v.begin - k0, 0, kTile);
      const int64_t hi = v.end > v.begin ? std::clamp<int64_t>(v.end - k0, 0, kTile) : 0;
      std::fill(t, t + std::min(lo, kTile), 0.0f);
      std::fill(t + std::max(hi, lo), t + kTile, 0.0f);
      if (hi <= lo) std::fill(t, t + kTile, 0.0f);
    }
  }

  // The dtype the score products' inputs share: bf16 when all of them are (then they may run on
  // bf16 pairs), float32 otherwise.
  static DType score_dtype(const IndexerKlLossParams& p) {
    const bool bf16 =
        p.query.dtype == DType::kBFloat16 && p.key.dtype == DType::kBFloat16 &&
        p.query_index.dtype == DType::kBFloat16 && p.key_index.dtype == DType::kBFloat16 &&
        (p.rope_dim == 0 ||
         (p.query_rope.dtype == DType::kBFloat16 && p.key_rope.dtype == DType::kBFloat16));
    return bf16 ? DType::kBFloat16 : DType::kFloat32;
  }

  const IndexerKlLossParams& p_;
  const kernels::KernelSet& k_;
  const kernels::KernelSet& kb_;  // the score products' kernels: k_, or bf16 pairs
  bool pairs_;
  Mask mask_;
  std::vector<Sequence> seqs_;
  int64_t group_, igroup_;
  int64_t dm_, dmp_, di_, dip_;
  int64_t dmw_, diw_;  // pair words per main and per index row, padded to kb_'s depth_align
  int64_t di16_;       // di rounded up to 16: rows of the key pass's left operand on pairs
  std::vector<int64_t> z_base_;  // first entry of sequence b in z_
  std::vector<float> z_;         // Z for every query row
};

void check_operand(const KlOperand& t, const char* name, bool needed) {
  if (needed && t.data == nullptr) throw ArgumentError(name, "is null");
}

}  // namespace

void validate(const IndexerKlLossParams& p, bool index_statistics) {
  validate(index_params(p));
  if (p.heads_q < 1 || p.heads_q > attention::kMaxHeads) {
    throw ArgumentError(
        "query", "N1 must be in [1, " + str(attention::kMaxHeads) + "], got " + str(p.heads_q));
  }
  if (p.heads_k < 1 || p.heads_k > attention::kMaxHeads) {
    throw ArgumentError(
        "key", "N2 must be in [1, " + str(attention::kMaxHeads) + "], got " + str(p.heads_k));
  }
  if (p.heads_q % p.heads_k != 0) {
    throw ArgumentError("key", "query heads N1=" + str(p.heads_q) +
                                   " must be a multiple of key heads N2=" + str(p.heads_k));
  }
  if (p.head_dim < 1 || p.head_dim > attention::kMaxHeadDim) {
    throw ArgumentError("query", "head dim D must be in [1, " + str(attention::kMaxHeadDim) +
                                     "], got " + str(p.head_dim));
  }
  if (p.rope_dim < 0 || p.head_dim + p.rope_dim > attention::kMaxHeadDim) {
    throw ArgumentError("query_rope", "D + Dr must be <= " + str(attention::kMaxHeadDim) +
                                          ", got Dr = " + str(p.rope_dim));
  }
  if (!std::isfinite(p.scale)) throw ArgumentError("scale_value", "must be finite");
  if (sequence_work(indexer_sequences(index_params(p))).pairs) {
    check_operand(p.query, "query", true);
    check_operand(p.key, "key", true);
    check_operand(p.query_rope, "query_rope", p.rope_dim > 0);
    check_operand(p.key_rope, "key_rope", p.rope_dim > 0);
    check_operand(p.query_index, "query_index", true);
    check_operand(p.key_index, "key_index", true);
    check_operand(p.weights, "weights", true);
    const std::pair<const void*, const char*> needed[] = {
        {p.softmax_max, "softmax_max"},
        {p.softmax_sum, "softmax_sum"},
        {p.softmax_max_index, "softmax_max_index"},
        {p.softmax_sum_index, "softmax_sum_index"},
        {p.d_query_index.data, "d_query_index"},
        {p.d_key_index.data, "d_key_index"},
        {p.d_weights.data, "d_weights"},
    };
    for (const auto& [ptr, name] : needed) {
      const bool skipped = !index_statistics && (name == std::string_view("softmax_max_index") ||
                                                 name == std::string_view("softmax_sum_index"));
      if (ptr == nullptr && !skipped) throw ArgumentError(name, "is null");
    }
  }
  if (p.loss == nullptr) throw ArgumentError("loss", "is null");
}

namespace {

template <class V>  // View or MutableView
int64_t operand_offset(const IndexerKlLossParams& p, const V& v, int64_t b, int64_t token,
                       int64_t head) {
  return (p.layout == Layout::kBSND ? b * v.sb : 0) + token * v.ss + head * v.sn;
}

bool operand_non_finite(const IndexerKlLossParams& p, const KlOperand& t, int64_t b, int64_t token,
                        int64_t heads, int64_t dim) {
  for (int64_t h = 0; h < heads; ++h) {
    if (row_non_finite(t.data, t.dtype, operand_offset(p, t, b, token, h), t.sd, dim)) {
      return true;
    }
  }
  return false;
}

// A block of n statistics: NaN or +inf anywhere (`max_of_rows`: -inf allowed), or any
// non-finite sum.
bool statistics_non_finite(const float* x, int64_t n, bool max_of_rows) {
  int64_t hits = 0;
  for (int64_t i = 0; i < n; ++i) {
    hits += max_of_rows ? (x[i] != x[i] || x[i] == kInf) : !std::isfinite(x[i]);
  }
  return hits != 0;
}

// Query rows [i0, i1) of seq (keys: key rows) against reads_non_finite's rule.
bool rows_non_finite(const IndexerKlLossParams& p, const Sequence& seq, bool keys, int64_t i0,
                     int64_t i1, bool index_statistics) {
  const int64_t b = seq.batch;
  const bool tnd = p.layout == Layout::kTND;
  for (int64_t i = i0; i < i1; ++i) {
    if (keys) {
      const int64_t pos = seq.k_begin + i;
      if (operand_non_finite(p, p.key, b, pos, p.heads_k, p.head_dim) ||
          (p.rope_dim > 0 && operand_non_finite(p, p.key_rope, b, pos, p.heads_k, p.rope_dim)) ||
          operand_non_finite(p, p.key_index, b, pos, p.index_heads_k, p.index_dim)) {
        return true;
      }
      continue;
    }
    const int64_t pos = seq.q_begin + i;
    if (operand_non_finite(p, p.query, b, pos, p.heads_q, p.head_dim) ||
        (p.rope_dim > 0 && operand_non_finite(p, p.query_rope, b, pos, p.heads_q, p.rope_dim)) ||
        operand_non_finite(p, p.query_index, b, pos, p.index_heads_q, p.index_dim) ||
        row_non_finite(p.weights.data, p.weights.dtype, operand_offset(p, p.weights, b, pos, 0),
                       p.weights.sn, p.index_heads_q)) {
      return true;
    }
  }
  if (keys) return false;
  // The statistics of rows [i0, i1): [B, N2, S1, G] / [N2, T1, G] and [B, N2index, S1] /
  // [N2index, T1], contiguous.
  const int64_t group = p.heads_q / p.heads_k, rows = i1 - i0;
  for (int64_t n = 0; n < p.heads_k; ++n) {
    const int64_t at = ((tnd ? n : b * p.heads_k + n) * p.seq_q + seq.q_begin + i0) * group;
    if (statistics_non_finite(p.softmax_max + at, rows * group, true) ||
        statistics_non_finite(p.softmax_sum + at, rows * group, false)) {
      return true;
    }
  }
  for (int64_t g = 0; index_statistics && g < p.index_heads_k; ++g) {
    const int64_t at = (tnd ? g : b * p.index_heads_k + g) * p.seq_q + seq.q_begin + i0;
    if (statistics_non_finite(p.softmax_max_index + at, rows, true) ||
        statistics_non_finite(p.softmax_sum_index + at, rows, false)) {
      return true;
    }
  }
  return false;
}

}  // namespace

bool reads_non_finite(const IndexerKlLossParams& p, const std::vector<Sequence>& seqs,
                      bool index_statistics, const Executor& executor) {
  struct Part {
    int64_t seq;
    bool keys;
    int64_t begin, end;
  };
  constexpr int64_t kRows = 256;
  std::vector<Part> parts;
  for (int64_t s = 0; s < static_cast<int64_t>(seqs.size()); ++s) {
    if (seqs[s].q_len == 0 || seqs[s].k_len == 0) continue;  // nothing of it is read
    for (const bool keys : {false, true}) {
      const int64_t len = keys ? seqs[s].k_len : seqs[s].q_len;
      for (int64_t i = 0; i < len; i += kRows) {
        parts.push_back({s, keys, i, std::min(len, i + kRows)});
      }
    }
  }
  std::vector<char> found(parts.size(), 0);
  run_dynamic(executor, static_cast<int64_t>(parts.size()), [&](int64_t t, int) {
    const Part& part = parts[t];
    found[t] =
        rows_non_finite(p, seqs[part.seq], part.keys, part.begin, part.end, index_statistics);
  });
  return std::any_of(found.begin(), found.end(), [](char f) { return f != 0; });
}

void write_non_finite(const IndexerKlLossParams& p, const std::vector<Sequence>& seqs) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> row(std::max<int64_t>(p.index_dim, 1), nan);
  for (const Sequence& seq : seqs) {
    if (seq.q_len == 0 || seq.k_len == 0) continue;  // its rows stay as the caller filled them
    for (int64_t i = 0; i < seq.q_len; ++i) {
      const int64_t pos = seq.q_begin + i;
      for (int64_t h = 0; h < p.index_heads_q; ++h) {
        const KlGradient& dq = p.d_query_index;
        store_row(dq.data, dq.dtype, operand_offset(p, dq, seq.batch, pos, h), dq.sd, p.index_dim,
                  row.data(), 1.0f);
        const KlGradient& dw = p.d_weights;
        store_row(dw.data, dw.dtype, operand_offset(p, dw, seq.batch, pos, h), 1, 1, row.data(),
                  1.0f);
      }
    }
    for (int64_t j = 0; j < seq.k_len; ++j) {
      for (int64_t g = 0; g < p.index_heads_k; ++g) {
        const KlGradient& dk = p.d_key_index;
        store_row(dk.data, dk.dtype, operand_offset(p, dk, seq.batch, seq.k_begin + j, g), dk.sd,
                  p.index_dim, row.data(), 1.0f);
      }
    }
  }
  *p.loss = nan;
}

void dense_lightning_indexer_grad_kl_loss(const IndexerKlLossParams& p, const Executor& executor,
                                          Isa isa) {
  validate(p);
  require_supported(isa);
  const std::vector<Sequence> seqs = indexer_sequences(index_params(p));
  if (reads_non_finite(p, seqs, true, executor)) {
    write_non_finite(p, seqs);
    return;
  }
  KlLoss run(p, isa);
  std::vector<std::unique_ptr<KlLoss::Scratch>> scratch(std::max(1, executor.num_workers()));
  auto scratch_of = [&](int thread) -> KlLoss::Scratch& {
    if (!scratch[thread]) scratch[thread] = std::make_unique<KlLoss::Scratch>(run);
    return *scratch[thread];
  };
  // Units are handed out most expensive first (causal tiles differ up to the sequence length);
  // each writes only its own rows, and the loss adds the units' shares in a fixed order.
  auto by_cost = [](const std::vector<Unit>& units) {
    std::vector<int64_t> order(units.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return units[a].cost > units[b].cost; });
    return order;
  };
  const std::vector<Unit> queries = run.units(true);
  const std::vector<int64_t> query_order = by_cost(queries);
  std::vector<double> loss(queries.size(), 0.0);
  run_dynamic(executor, static_cast<int64_t>(queries.size()), [&](int64_t i, int thread) {
    const int64_t u = query_order[i];
    const kernels::WorkerScope scope(run.products());
    loss[u] = run.query_tile(scratch_of(thread), queries[u]);
  });
  const std::vector<Unit> keys = run.units(false);
  const std::vector<int64_t> key_order = by_cost(keys);
  run_dynamic(executor, static_cast<int64_t>(keys.size()), [&](int64_t i, int thread) {
    const kernels::WorkerScope scope(run.products());
    run.key_block(scratch_of(thread), keys[key_order[i]]);
  });
  double total = 0.0;
  for (double l : loss) total += l;
  *p.loss = static_cast<float>(total);
}

}  // namespace opmesh::core
