#include "sparse_kl_loss.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "../aligned_buffer.h"
#include "../attention/sparse_attention_detail.h"
#include "../errors.h"
#include "../kernels/kernel_set.h"
#include "../kernels/row_loads.h"
#include "../work_split.h"
#include "indexer.h"

namespace opmesh::core {
namespace {

using kernels::kKeyTile;
using kernels::round_up;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kTokensPerTask = 8;

std::string str(int64_t v) { return std::to_string(v); }

// Offsets of a token's (query side) or key's (key side) row of an operand's view (TND: the
// batch stride is 0). V: View or MutableView.
template <class V>
int64_t query_row(const V& st, const Sequence& s, int64_t i, int64_t head) {
  return s.batch * st.sb + (s.q_begin + i) * st.ss + head * st.sn;
}

template <class V>
int64_t key_row(const V& st, const Sequence& s, int64_t j, int64_t head) {
  return s.batch * st.sb + (s.k_begin + j) * st.ss + head * st.sn;
}

class SparseKl {
 public:
  SparseKl(const SparseKlLossParams& sp, Isa isa)
      : sp_(sp),
        p_(sp.dense),
        k_(kernels::float32_set(isa)),
        kb_(kernels::select_set(isa, main_dtype(sp.dense), -1, true)),
        pairs_(kb_.word == kernels::Word::kBf16Pair),
        ki_(kernels::select_set(isa, index_dtype(sp.dense), -1, true)),
        ipairs_(ki_.word == kernels::Word::kBf16Pair),
        mask_(compressed(indexer_mask(p_.sparse_mode, p_.pre_tokens, p_.next_tokens), p_)),
        seqs_(indexer_sequences(index_params(p_))),
        g_(p_.heads_q / p_.heads_k),
        ig_(p_.index_heads_q / p_.index_heads_k),
        ig_t_(ig_ <= kKeyTile ? kKeyTile : ig_),
        dm_(p_.head_dim + p_.rope_dim),
        dmp_(round_up(dm_, 16)),
        dip_(round_up(p_.index_dim, 16)),
        dmw_(round_up((dm_ + 1) / 2, kb_.depth_align)),
        diw_(round_up((p_.index_dim + 1) / 2, ki_.depth_align)),
        head_pairs_(ipairs_ ? round_up(ig_, kKeyTile) : 0),
        sign_width_((ig_ + 7) / 8),
        keys_in_place_(main_keys_in_place(p_, kb_)),
        index_keys_in_place_(ipairs_ && p_.key_index.sd == 1 && p_.index_dim == 2 * diw_) {
    const int64_t rows = p_.layout == Layout::kTND ? p_.seq_q : p_.batch * p_.seq_q;
    active_.assign(rows * p_.index_heads_k, 0);
    // Both are written by the first pass for every entry the second reads (a selected, visible
    // entry of an active row), so neither is zero-filled first.
    d_index_.grow_uninitialized(rows * p_.index_heads_k * sp_.sparse_count);
    const int64_t sign_bytes = rows * p_.index_heads_k * sp_.sparse_count * sign_width_;
    keep_signs_ = sign_bytes <= sp_.sign_budget_bytes;
    if (keep_signs_) signs_.grow_uninitialized(sign_bytes);
  }

  const std::vector<Sequence>& sequences() const { return seqs_; }
  // The kernels whose worker setup the tasks run under: a pair set either product uses.
  const kernels::KernelSet& kernel_set() const { return pairs_ ? kb_ : ki_; }

  struct Scratch {
    explicit Scratch(const SparseKl& r)
        : q(r.p_.heads_q * r.dmp_),
          qi(r.p_.index_heads_q * r.dip_),
          qit(kKeyTile * r.ig_t_),
          krow(kKeyTile * r.dmp_),
          kt(r.dmp_ * kKeyTile),
          s(r.g_ * kKeyTile),
          irow(kKeyTile * r.dip_),
          kit(r.dip_ * kKeyTile),
          coef((r.ig_ + 1) * kKeyTile),
          acc(std::max(r.ig_ * std::max(r.dip_, kKeyTile), kKeyTile * r.dip_)),
          lse(r.p_.heads_q),
          w(r.p_.index_heads_q),
          ones(std::max(r.ig_, kKeyTile), 1.0f),
          dw(r.ig_),
          qp(r.pairs_ ? (r.p_.heads_q + 16) * r.dmw_ : 0),
          kstage(r.pairs_ ? kKeyTile * r.dmw_ : 0),
          ktp(r.pairs_ ? r.dmw_ * kKeyTile : 0),
          qip(r.ipairs_ ? (r.p_.index_heads_q + 16) * r.diw_ : 0),
          istage(r.ipairs_ ? kKeyTile * r.diw_ : 0),
          kitp(r.ipairs_ ? r.diw_ * kKeyTile : 0),
          coef16(r.ipairs_ ? (round_up(r.ig_, 16) + 16) * 2 * kKeyTile : 0),
          coef_lo(r.ipairs_ ? (r.ig_ + 1) * kKeyTile : 0),
          qih(r.head_pairs_ * r.dip_),
          words(r.ipairs_ ? 2 * kKeyTile * kKeyTile : 0),
          qt(r.keys_in_place_ ? r.p_.heads_k * r.q_chunks() * r.dmw_ * kKeyTile : 0),
          st(r.keys_in_place_ ? kKeyTile * round_up(r.g_, 16) : 0) {}
    AlignedBuffer<float> q;       // [N1][dmp] main query rows (query | rope), zero-padded
    AlignedBuffer<float> qi;      // [N1index][dip] index query rows, zero-padded
    AlignedBuffer<float> qit;     // pass 2: [64][ig_t] coefficients, transposed
    AlignedBuffer<float> krow;    // [64][dmp] selected main key rows
    AlignedBuffer<uint32_t> kt;   // [dmp][64] the same, transposed
    AlignedBuffer<float> s;       // [G][64] main scores, then probabilities
    AlignedBuffer<float> irow;    // [64][dip] selected index key rows
    AlignedBuffer<uint32_t> kit;  // [dip][64] the same, transposed
    AlignedBuffer<float> coef;    // [ig][64] coefficients of one chunk (a zero row after)
    AlignedBuffer<float> acc;     // pass 1 [ig][dip] d_query_index; pass 2 [ig][64], [64][dip]
    std::vector<float> lse;       // [N1] main log-sum-exp (+inf: nothing selected)
    std::vector<float> w;         // [N1index]
    std::vector<float> ones;
    std::vector<double> dw;
    std::vector<float> prob;      // P over the row's selected keys, padded to 64
    std::vector<float> score;     // I, padded to 64
    AlignedBuffer<float> sidx;    // [ig][padded] the index scores of one group
    std::vector<float> dsc;       // dI
    std::vector<float> row_keys;  // [padded][dip] the row's selected index key rows
    std::vector<int32_t> keys, entries;
    std::vector<float> key_grad;  // pass 2: [keys][dip]
    std::vector<int32_t> hits, hit_entries;
    std::vector<uint8_t> sign_rows;    // [sign bytes][keys] signs of a row's keys, byte-major
    std::vector<uint64_t> sign_words;  // [keys] signs of a row's keys for 64 heads, bit h for h
    std::vector<uint16_t> w16;         // pass 2: the group's weights' bf16 bits
    std::vector<float> hit_d;
    // bf16 inputs on pair kernels: the main score product's operands as bf16 pairs.
    AlignedBuffer<uint32_t> qp;      // [N1 (+16 readable)][dmw] main query rows (query | rope)
    AlignedBuffer<uint32_t> kstage;  // [64][dmw] selected main key rows
    AlignedBuffer<uint32_t> ktp;     // [dmw][64] the same, packed
    // bf16 index inputs on pair kernels: the index products' operands as bf16 pairs.
    AlignedBuffer<uint32_t> qip;     // [N1index (+16 readable)][diw] index query rows
    AlignedBuffer<uint32_t> istage;  // [64][diw] selected index key rows
    AlignedBuffer<uint32_t> kitp;    // [diw][64] the same, packed
    // [ig (+16 readable)][padded words] a row's coefficients as key pairs: per chunk of 64 keys
    // 32 words of bf16(coef), then 32 of bf16(coef - bf16(coef)), so that one product over both
    // keeps float32's accuracy.
    AlignedBuffer<uint16_t> coef16;
    AlignedBuffer<float> coef_lo;   // [ig + 1][64] coef - bf16(coef) (the last row zero)
    AlignedBuffer<uint32_t> qih;    // pass 2: [head pairs][dip] group's index queries, head pairs
    AlignedBuffer<uint32_t> words;  // pass 2: [64][64] coefficient head pairs, then transposed
    // [padded][dip] the row's index keys as key pairs: per chunk of 64 keys their 32 pairs, twice
    // (the B operand of coef16's two halves).
    AlignedBuffer<uint32_t> key_pairs;
    // Main keys read in place (keys_in_place_): each key head's query rows transposed per 64 rows
    // (gathered_product's B operand), and its S^T.
    AlignedBuffer<uint32_t> qt;
    AlignedBuffer<float> st;
  };

  // Pass 1 for token i of s: the loss of its rows (returned), d_query_index, d_weights and the
  // kept dI of each of its selection entries.
  double token_pass(Scratch& sc, const Sequence& s, int64_t i) {
    const KeyRange vis = visible_keys(mask_, s, i);
    load_token(sc, s, i);
    double loss = 0.0;
    for (int64_t n = 0; n < sp_.index_heads; ++n) {
      select(s, i, n, vis, sc);
      const int64_t nk = static_cast<int64_t>(sc.keys.size());
      const int64_t padded = round_up(std::max<int64_t>(nk, 1), kKeyTile);
      sc.prob.assign(padded, 0.0f);
      double z = 0.0;
      for (int64_t c0 = 0; c0 < nk; c0 += kKeyTile) {
        target_chunk(sc, s, c0, std::min(kKeyTile, nk - c0));
      }
      for (int64_t c = 0; c < nk; ++c) z += sc.prob[c];
      const int64_t g_end = sp_.index_heads == 1 ? p_.index_heads_k : n + 1;
      for (int64_t g = sp_.index_heads == 1 ? 0 : n; g < g_end; ++g) {
        if (z > 0.0 && std::isfinite(z)) {
          loss += group_pass(sc, s, i, g, nk, padded, z);
        } else {
          // No target mass: the row contributes nothing.
          std::fill(sc.acc.data(), sc.acc.data() + ig_ * dip_, 0.0f);
          std::fill(sc.dw.begin(), sc.dw.end(), 0.0);
          if (!std::isfinite(z)) loss += std::numeric_limits<double>::quiet_NaN();
          store_group(sc, s, i, g);
        }
      }
    }
    return loss;
  }

  // How many selection entries of the active rows name each key of s (index key head g): the
  // key pass's work per key.
  std::vector<int64_t> selections_per_key(const Sequence& s, int64_t g) const {
    std::vector<int64_t> count(s.k_len, 0);
    const int64_t n = sp_.index_heads == 1 ? 0 : g;
    for (int64_t i = 0; i < s.q_len; ++i) {
      if (!active_[token(s, i) * p_.index_heads_k + g]) continue;
      const KeyRange vis = visible_keys(mask_, s, i);
      const int32_t* idx = static_cast<const int32_t*>(sp_.indices.data) + indices_row(s, i, n);
      for (int64_t e = 0; e < sp_.sparse_count; ++e) {
        const int64_t v = idx[e * sp_.indices.sd];
        if (v >= vis.begin && v < vis.end) ++count[v];
      }
    }
    return count;
  }

  // Pass 2: d_key_index of keys [j0, j1) of s and index key head g, summed over the tokens that
  // selected them in token order.
  void key_pass(Scratch& sc, const Sequence& s, int64_t g, int64_t j0, int64_t j1) const {
    const int64_t n = sp_.index_heads == 1 ? 0 : g;
    sc.key_grad.assign((j1 - j0) * dip_, 0.0f);
    for (int64_t i = 0; i < s.q_len; ++i) {
      const KeyRange vis = visible_keys(mask_, s, i);
      const int64_t lo = std::max(j0, vis.begin), hi = std::min(j1, vis.end);
      if (hi <= lo) continue;
      const int64_t drow = token(s, i) * p_.index_heads_k + g;
      if (!active_[drow]) continue;
      const int32_t* idx = static_cast<const int32_t*>(sp_.indices.data) + indices_row(s, i, n);
      const float* d = d_index_.data() + drow * sp_.sparse_count;
      // The entries in [lo, hi), compacted without a branch (each entry written, the end moved
      // past it when it is in the block): which entries hit is not predictable.
      sc.hits.resize(sp_.sparse_count);
      sc.hit_d.resize(round_up(sp_.sparse_count, kKeyTile));
      sc.hit_entries.resize(sp_.sparse_count);
      size_t count = 0;
      for (int64_t e = 0; e < sp_.sparse_count; ++e) {
        const int64_t v = idx[e * sp_.indices.sd];
        sc.hits[count] = static_cast<int32_t>(v);
        sc.hit_d[count] = d[e];
        sc.hit_entries[count] = static_cast<int32_t>(e);
        count += static_cast<size_t>(v >= lo && v < hi);
      }
      if (count == 0) continue;
      sc.hits.resize(count);
      sc.hit_d.resize(round_up(count, kKeyTile));
      sc.hit_entries.resize(count);
      const bool bf16_weights = load_group(sc, s, i, g);
      const float* w = sc.w.data() + g * ig_;
      for (size_t c0 = 0; c0 < sc.hits.size(); c0 += kKeyTile) {
        const int64_t m = std::min<int64_t>(kKeyTile, sc.hits.size() - c0);
        // The coefficients dI w [S > 0] [ig][64] (from the kept signs, or from the index scores
        // recomputed in the same layout), then d_key_index rows += coef^T x query rows.
        std::fill(sc.hit_d.begin() + c0 + m, sc.hit_d.begin() + c0 + kKeyTile, 0.0f);
        float* tmp = sc.acc.data();
        if (bf16_weights) {
          weight_key_product(sc, s, g, drow, c0, m, tmp);
          for (int64_t c = 0; c < m; ++c) {
            k_.rows.add_scaled(sc.key_grad.data() + (sc.hits[c0 + c] - j0) * dip_, tmp + c * dip_,
                               sc.hit_d[c0 + c], p_.index_dim);
          }
          continue;
        }
        if (keep_signs_ && ipairs_) {
          sign_key_product(sc, drow, c0, m, w, tmp);
          for (int64_t c = 0; c < m; ++c) {
            k_.rows.add_into(sc.key_grad.data() + (sc.hits[c0 + c] - j0) * dip_, tmp + c * dip_,
                             p_.index_dim);
          }
          continue;
        }
        float* coef = sc.coef.data();
        if (keep_signs_) {
          kept_coefficients(sc, drow, c0, m, w, coef);
        } else {
          float* st = sc.acc.data();
          index_product(sc, s, g, sc.hits.data() + c0, m, st, kKeyTile, nullptr);
          for (int64_t h = 0; h < ig_; ++h) {
            k_.rows.masked_scale(st + h * kKeyTile, sc.hit_d.data() + c0, w[h],
                                 coef + h * kKeyTile);
          }
        }
        if (ipairs_) {
          pair_key_product(sc, coef, m, tmp);
        } else {
          const float* coef_t = transpose_coefficients(sc, coef);
          k_.gemm({coef_t, ig_t_, sc.qi.data() + g * ig_ * dip_, dip_, tmp, dip_, m, dip_, ig_,
                   nullptr, 1.0f});
        }
        for (int64_t c = 0; c < m; ++c) {
          k_.rows.add_into(sc.key_grad.data() + (sc.hits[c0 + c] - j0) * dip_, tmp + c * dip_,
                           p_.index_dim);
        }
      }
    }
    for (int64_t j = j0; j < j1; ++j) {
      const KlGradient& out = p_.d_key_index;
      store_row(k_, out.data, out.dtype, key_row(out, s, j, g), out.sd, p_.index_dim,
                sc.key_grad.data() + (j - j0) * dip_, 1.0f);
    }
  }

 private:
  // Pass 2: coef[h][c] = dI w[h] [S_h > 0] of the chunk's m hits from c0 (row drow) from the
  // kept signs, as masked_scale forms it from the scores; columns past m are 0.
  void kept_coefficients(Scratch& sc, int64_t drow, size_t c0, int64_t m, const float* w,
                         float* coef) const {
    // The hits' sign bytes, byte b of every hit in row b.
    const uint8_t* row = signs_.data() + drow * sp_.sparse_count * sign_width_;
    sc.sign_rows.assign(sign_width_ * kKeyTile, 0);  // columns past m: no sign, coefficient 0
    for (int64_t c = 0; c < m; ++c) {
      const uint8_t* bits = row + sc.hit_entries[c0 + c] * sign_width_;
      for (int64_t b = 0; b < sign_width_; ++b) sc.sign_rows[b * kKeyTile + c] = bits[b];
    }
    const float* d = sc.hit_d.data() + c0;  // 0 past m
    for (int64_t h = 0; h < ig_; ++h) {
      k_.rows.sign_scale(sc.sign_rows.data() + (h / 8) * kKeyTile, static_cast<int>(h % 8), d, w[h],
                         coef + h * kKeyTile);
    }
  }

  // Pass 2 on pairs from the kept signs: out[c] = sum_h coef[h][c] qi[h] for the chunk's m hits
  // from c0 (row drow), with each hit's coefficient row built as the product's pair operand
  // straight from its sign bits (sign_pairs): the bits of kept_coefficients and pair_key_product.
  void sign_key_product(Scratch& sc, int64_t drow, size_t c0, int64_t m, const float* w,
                        float* out) const {
    const uint8_t* row = signs_.data() + drow * sp_.sparse_count * sign_width_;
    hit_products(sc, m, 2, out, [&](int64_t c, int64_t h0, int64_t n, uint32_t* words) {
      const uint8_t* bits = row + sc.hit_entries[c0 + c] * sign_width_ + h0 / 8;
      ki_.rows.sign_pairs(bits, n, w + h0, sc.hit_d[c0 + c], words);
    });
  }

  // The key pass's products on pairs, 64 heads a block: build(c, h0, n, words) writes hit c's
  // operand row for the block's n heads from h0 (words_per_pair words per head pair), then one
  // product against the group's query pairs (qih) into out; later blocks add to the first.
  template <class Build>
  void hit_products(Scratch& sc, int64_t m, int64_t words_per_pair, float* out, Build build) const {
    uint32_t* a = sc.words.data();  // [64][64] words: one hit's operand row per row
    for (int64_t h0 = 0; h0 < ig_; h0 += kKeyTile) {
      const int64_t n = std::min(kKeyTile, ig_ - h0);
      const int64_t used = words_per_pair * ((n + 1) / 2);
      const int64_t depth = round_up(used, ki_.depth_align);
      for (int64_t c = 0; c < m; ++c) {
        uint32_t* words = a + c * kKeyTile;
        build(c, h0, n, words);
        std::fill(words + used, words + depth, 0u);
      }
      ki_.gemm({a, kKeyTile, sc.qih.data() + h0 * dip_, dip_, out, dip_, m, dip_, depth,
                h0 == 0 ? nullptr : sc.ones.data(), 1.0f});
    }
  }

  // Whether the group's weights w are bf16 values (always for bf16 weights), with their bf16
  // bits into sc.w16.
  bool weights_as_bf16(Scratch& sc, const float* w) const {
    sc.w16.resize(ig_);
    for (int64_t h = 0; h < ig_; ++h) {
      uint32_t u;
      std::memcpy(&u, &w[h], sizeof(u));
      if ((u & 0xffffu) != 0) return false;
      sc.w16[h] = static_cast<uint16_t>(u >> 16);
    }
    return true;
  }

  // Pass 2 on pairs with bf16 weights: out[c] = sum_h [S_h > 0] w[h] qi[h] for the chunk's m
  // hits from c0 (row drow), their dI applied after. The signs (kept, or from the index scores
  // recomputed: sign_words) select the weights' bf16 values as the product's pair operand
  // (sign_weights): exact, so one product over the heads' p pairs carries them, where float32
  // coefficients dI w take two.
  void weight_key_product(Scratch& sc, const Sequence& s, int64_t g, int64_t drow, size_t c0,
                          int64_t m, float* out) const {
    const uint8_t* kept = signs_.data() + drow * sp_.sparse_count * sign_width_;
    if (!keep_signs_) {
      float* st = sc.acc.data();  // [ig][64] scores, read before the products overwrite them
      index_product(sc, s, g, sc.hits.data() + c0, m, st, kKeyTile, nullptr);
      sc.sign_words.resize(round_up(ig_, kKeyTile));
      for (int64_t h0 = 0; h0 < ig_; h0 += kKeyTile) {
        k_.rows.sign_words(st + h0 * kKeyTile, kKeyTile, std::min(kKeyTile, ig_ - h0), m,
                           sc.sign_words.data() + h0);
      }
    }
    hit_products(sc, m, 1, out, [&](int64_t c, int64_t h0, int64_t n, uint32_t* words) {
      const uint8_t* bits = keep_signs_
                                ? kept + sc.hit_entries[c0 + c] * sign_width_ + h0 / 8
                                : reinterpret_cast<const uint8_t*>(sc.sign_words.data() + h0 + c);
      ki_.rows.sign_weights(bits, n, sc.w16.data() + h0, words);
    });
  }

  // The token's output row: BSND b * S1 + i, TND q_begin + i.
  int64_t token(const Sequence& s, int64_t i) const {
    return p_.layout == Layout::kTND ? s.q_begin + i : s.batch * p_.seq_q + i;
  }

  int64_t indices_row(const Sequence& s, int64_t i, int64_t n) const {
    const View& st = sp_.indices;
    return (p_.layout == Layout::kTND ? 0 : s.batch * st.sb) + (s.q_begin + i) * st.ss + n * st.sn;
  }

  // The keys selection row (s, i, n) picks among the visible ones, in entry order, with their
  // entries.
  void select(const Sequence& s, int64_t i, int64_t n, const KeyRange& vis, Scratch& sc) const {
    sc.keys.clear();
    sc.entries.clear();
    if (vis.end <= vis.begin) return;
    const int32_t* idx = static_cast<const int32_t*>(sp_.indices.data) + indices_row(s, i, n);
    for (int64_t e = 0; e < sp_.sparse_count; ++e) {
      const int64_t v = idx[e * sp_.indices.sd];
      if (v < vis.begin || v >= vis.end) continue;  // -1 and masked keys
      sc.keys.push_back(static_cast<int32_t>(v));
      sc.entries.push_back(static_cast<int32_t>(e));
    }
  }

  void load(const KlOperand& o, int64_t offset, int64_t n, float* dst) const {
    sparse::load(k_, o.data, o.dtype, offset, o.sd, n, dst);
  }

  // Main query rows and log-sum-exps, index query rows and weights of token i.
  void load_token(Scratch& sc, const Sequence& s, int64_t i) const {
    for (int64_t h = 0; h < p_.heads_q && pairs_; ++h) {
      uint32_t* words = sc.qp.data() + h * dmw_;
      std::fill(words, words + dmw_, 0u);
      joined_bf16(
          p_.query, p_.query_rope, [&](const View& v) { return query_row(v, s, i, h); },
          reinterpret_cast<uint16_t*>(words));
    }
    for (int64_t kh = 0; kh < p_.heads_k && keys_in_place_; ++kh) {
      sparse::transpose_group(kb_, sc.qp.data() + kh * g_ * dmw_, g_, dmw_, dmw_,
                              sc.qt.data() + kh * q_chunks() * dmw_ * kKeyTile);
    }
    for (int64_t h = 0; h < p_.heads_q && !pairs_; ++h) {
      float* q = sc.q.data() + h * dmp_;
      load(p_.query, query_row(p_.query, s, i, h), p_.head_dim, q);
      if (p_.rope_dim > 0) {
        load(p_.query_rope, query_row(p_.query_rope, s, i, h), p_.rope_dim, q + p_.head_dim);
      }
      std::fill(q + dm_, q + dmp_, 0.0f);
    }
    for (int64_t kh = 0; kh < p_.heads_k; ++kh) {
      const int64_t stats = p_.layout == Layout::kTND
                                ? (kh * p_.seq_q + s.q_begin + i) * g_
                                : ((s.batch * p_.heads_k + kh) * p_.seq_q + i) * g_;
      for (int64_t r = 0; r < g_; ++r) {
        // A log-sum-exp of -inf (a max of -inf, or no positive sum): no target mass (+inf).
        const float m = p_.softmax_max[stats + r];
        const float l = p_.softmax_sum[stats + r];
        sc.lse[kh * g_ + r] = m != -kInf && l > 0.0f ? m + std::log(l) : kInf;
      }
    }
    for (int64_t h = 0; h < p_.index_heads_q; ++h) load_index_query(sc, s, i, h);
    load_row(p_.weights.data, p_.weights.dtype, query_row(p_.weights, s, i, 0), p_.weights.sn,
             p_.index_heads_q, sc.w.data());
  }

  // Index query row h of token i, zero-padded: float32 into sc.qi or bf16 pairs into sc.qip.
  void load_index_query(Scratch& sc, const Sequence& s, int64_t i, int64_t h) const {
    const int64_t offset = query_row(p_.query_index, s, i, h);
    if (ipairs_) {
      uint32_t* words = sc.qip.data() + h * diw_;
      std::fill(words, words + diw_, 0u);
      copy_bf16(p_.query_index, offset, p_.index_dim, reinterpret_cast<uint16_t*>(words));
      return;
    }
    float* q = sc.qi.data() + h * dip_;
    load(p_.query_index, offset, p_.index_dim, q);
    std::fill(q + p_.index_dim, q + dip_, 0.0f);
  }

  // Pass 2: token i's weights and group g's index query rows. On pairs, returns whether the
  // group's weights are bf16 values (weights_as_bf16: the key pass then takes one product over
  // the query pairs, not two halves).
  bool load_group(Scratch& sc, const Sequence& s, int64_t i, int64_t g) const {
    load_row(p_.weights.data, p_.weights.dtype, query_row(p_.weights, s, i, 0), p_.weights.sn,
             p_.index_heads_q, sc.w.data());
    for (int64_t r = 0; r < ig_; ++r) load_index_query(sc, s, i, g * ig_ + r);
    if (!ipairs_) return false;
    const bool bf16_weights = weights_as_bf16(sc, sc.w.data() + g * ig_);
    // Per block of 64 heads from h0 with p pairs: qih row h0 + l holds pair l, (qi[h0 + 2l][e],
    // qi[h0 + 2l + 1][e]) (an odd last head with zeros), and for the two halves row h0 + p + l
    // the same: the B operand of pair_key_product's two halves.
    const uint16_t* q16 = reinterpret_cast<const uint16_t*>(sc.qip.data() + g * ig_ * diw_);
    for (int64_t h0 = 0; h0 < ig_; h0 += kKeyTile) {
      const int64_t p = (std::min(kKeyTile, ig_ - h0) + 1) / 2;
      for (int64_t l = 0; l < p; ++l) {
        const int64_t h = h0 + 2 * l;
        const uint16_t* second = h + 1 < ig_ ? q16 + (h + 1) * 2 * diw_ : nullptr;
        uint32_t* row = sc.qih.data() + (h0 + l) * dip_;
        ki_.rows.interleave_bf16(q16 + h * 2 * diw_, second, p_.index_dim, row);
        if (!bf16_weights) std::memcpy(row + p * dip_, row, dip_ * sizeof(uint32_t));
      }
      if (bf16_weights) {  // the rows the one product's depth padding meets: zeros
        uint32_t* pad = sc.qih.data() + (h0 + p) * dip_;
        std::fill(pad, pad + (round_up(p, ki_.depth_align) - p) * dip_, 0u);
      }
    }
    return bf16_weights;
  }

  // The index scores of group g against m index key rows keys[0..m) into `out` ([ig] rows,
  // stride ld, 64 columns); on pairs, with key_pairs also the rows as key pairs there
  // ([32][dip]).
  void index_product(Scratch& sc, const Sequence& s, int64_t g, const int32_t* keys, int64_t m,
                     float* out, int64_t ld, uint32_t* key_pairs,
                     kernels::LinesAhead ahead = {}) const {
    const char* rows[kKeyTile];
    if (!ipairs_) {
      for (int64_t c = 0; c < m; ++c) {
        ahead.next();
        float* k = sc.irow.data() + c * dip_;
        load_index_key(s, keys[c], g, k);
        rows[c] = reinterpret_cast<const char*>(k);
      }
      k_.pack_keys(rows, m, dip_, sc.kit.data());
      k_.gemm({sc.qi.data() + g * ig_ * dip_, dip_, sc.kit.data(), kKeyTile, out, ld, ig_, kKeyTile,
               dip_, nullptr, 1.0f});
      return;
    }
    // The rows where they lie when they are whole pair words (index_keys_in_place_), else
    // copied, zero-padded, to the stage; rows past m are zero either way.
    for (int64_t c = 0; c < kKeyTile; ++c) {
      ahead.next();
      if (index_keys_in_place_) {
        rows[c] = c < m ? static_cast<const char*>(p_.key_index.data) +
                              key_row(p_.key_index, s, keys[c], g) * sizeof(uint16_t)
                        : nullptr;
        continue;
      }
      uint32_t* words = sc.istage.data() + c * diw_;
      std::fill(words, words + diw_, 0u);
      if (c < m) {
        copy_bf16(p_.key_index, key_row(p_.key_index, s, keys[c], g), p_.index_dim,
                  reinterpret_cast<uint16_t*>(words));
      }
      rows[c] = reinterpret_cast<const char*>(words);
    }
    ki_.pack_keys(rows, m, diw_, sc.kitp.data());
    ki_.gemm({sc.qip.data() + g * ig_ * diw_, diw_, sc.kitp.data(), kKeyTile, out, ld, ig_,
              kKeyTile, diw_, nullptr, 1.0f});
    if (key_pairs == nullptr) return;
    for (int64_t l = 0; l < kKeyTile / 2; ++l) {
      uint32_t* pairs = key_pairs + l * dip_;
      if (index_keys_in_place_ && 2 * l >= m) {
        std::fill(pairs, pairs + p_.index_dim, 0u);
        continue;
      }
      const auto* first = reinterpret_cast<const uint16_t*>(rows[2 * l]);
      const auto* second = reinterpret_cast<const uint16_t*>(rows[2 * l + 1]);
      ki_.rows.interleave_bf16(first, second, p_.index_dim, pairs);
    }
    std::memcpy(key_pairs + kKeyTile / 2 * dip_, key_pairs, kKeyTile / 2 * dip_ * sizeof(uint32_t));
  }

  // coef [ig][64] transposed to [64][ig_t_]: by the kernel set's key packing (a transpose of
  // 64-row blocks) when the group fits one block, else element by element.
  const float* transpose_coefficients(Scratch& sc, const float* coef) const {
    float* out = sc.qit.data();
    if (ig_ <= kKeyTile) {
      const char* rows[kKeyTile];
      for (int64_t h = 0; h < ig_; ++h)
        rows[h] = reinterpret_cast<const char*>(coef + h * kKeyTile);
      k_.pack_keys(rows, ig_, kKeyTile, reinterpret_cast<uint32_t*>(out));
      return out;
    }
    for (int64_t h = 0; h < ig_; ++h) {
      for (int64_t c = 0; c < kKeyTile; ++c) out[c * ig_t_ + h] = coef[h * kKeyTile + c];
    }
    return out;
  }

  // On pairs: out[c] = sum_h coef[h][c] qi[h] for the m keys c of a chunk, with the group's heads
  // as the depth in pairs, 64 heads a product (later ones add to the first). Each product's
  // depth is the p pairs of bf16(coef), then the p pairs of bf16(coef - bf16(coef)), against
  // qih's two copies of the query pairs: float32's accuracy in one product.
  void pair_key_product(Scratch& sc, const float* coef, int64_t m, float* out) const {
    float* lo = sc.coef_lo.data();
    for (int64_t h = 0; h < ig_; ++h) {
      ki_.rows.bf16_residual(coef + h * kKeyTile, lo + h * kKeyTile);
    }
    uint32_t* paired = sc.words.data();
    uint32_t* transposed = sc.words.data() + kKeyTile * kKeyTile;
    const char* rows[kKeyTile];
    for (int64_t l = 0; l < kKeyTile; ++l) {
      rows[l] = reinterpret_cast<const char*>(paired + l * kKeyTile);
    }
    for (int64_t h0 = 0; h0 < ig_; h0 += kKeyTile) {
      const int64_t p = (std::min(kKeyTile, ig_ - h0) + 1) / 2;
      // paired[l] = (x[h0 + 2l], x[h0 + 2l + 1]) for coef, then for lo (their row ig is zero).
      for (int64_t l = 0; l < p; ++l) {
        const int64_t h = h0 + 2 * l;
        ki_.rows.pair_rows(coef + h * kKeyTile, coef + (h + 1) * kKeyTile, paired + l * kKeyTile);
        ki_.rows.pair_rows(lo + h * kKeyTile, lo + (h + 1) * kKeyTile, paired + (p + l) * kKeyTile);
      }
      ki_.pack_keys(rows, 2 * p, kKeyTile, transposed);
      ki_.gemm({transposed, kKeyTile, sc.qih.data() + h0 * dip_, dip_, out, dip_, m, dip_,
                round_up(2 * p, ki_.depth_align), h0 == 0 ? nullptr : sc.ones.data(), 1.0f});
    }
  }

  // Index key row of key j, head g, into k (zero-padded to dip).
  void load_index_key(const Sequence& s, int64_t j, int64_t g, float* k) const {
    load(p_.key_index, key_row(p_.key_index, s, j, g), p_.index_dim, k);
    std::fill(k + p_.index_dim, k + dip_, 0.0f);
  }

  // Prefetch hints for operand o's rows (head g) of the next chunk of the row's selected keys,
  // those from `from` (at most a tile), spread over `steps` loads of this chunk: the selection
  // gathers rows the hardware prefetchers do not see coming. `rows` holds their addresses.
  kernels::LinesAhead next_rows(const KlOperand& o, int64_t dim, const Scratch& sc,
                                const Sequence& s, size_t from, int64_t g, int64_t steps,
                                const char** rows) const {
    const int64_t n = from < sc.keys.size()
                          ? std::min<int64_t>(kKeyTile, static_cast<int64_t>(sc.keys.size() - from))
                          : 0;
    if (o.sd != 1 || dim == 0 || n == 0) return {};
    const int64_t bytes = dtype_size(o.dtype);
    for (int64_t c = 0; c < n; ++c) {
      rows[c] = static_cast<const char*>(o.data) + key_row(o, s, sc.keys[from + c], g) * bytes;
    }
    return kernels::LinesAhead({rows, n, dim * bytes}, steps);
  }

  // Calls load(c, j) for the chunk's m selected keys j (from c0), asking for the main key and
  // rope rows (key head kh) of the next chunk meanwhile.
  template <class Load>
  void each_chunk_key(const Scratch& sc, const Sequence& s, int64_t kh, int64_t c0, int64_t m,
                      Load load) const {
    const char* rows[2][kKeyTile];
    kernels::LinesAhead ahead[2] = {
        next_rows(p_.key, p_.head_dim, sc, s, c0 + m, kh, m, rows[0]),
        next_rows(p_.key_rope, p_.rope_dim, sc, s, c0 + m, kh, m, rows[1])};
    for (int64_t c = 0; c < m; ++c) {
      ahead[0].next();
      ahead[1].next();
      load(c, sc.keys[c0 + c]);
    }
  }

  // n bf16 elements of operand o at element `offset`, as they are.
  static void copy_bf16(const KlOperand& o, int64_t offset, int64_t n, uint16_t* dst) {
    sparse::copy_bf16(o.data, offset, o.sd, n, dst);
  }

  // A main row and its rope's (the rope after the head dim), as bf16 words; `row` gives a
  // view's offset of the row.
  template <class Row>
  void joined_bf16(const KlOperand& main, const KlOperand& rope, Row row, uint16_t* dst) const {
    copy_bf16(main, row(main), p_.head_dim, dst);
    if (p_.rope_dim > 0) copy_bf16(rope, row(rope), p_.rope_dim, dst + p_.head_dim);
  }

  // Whether the main scores read the selected key rows where they lie (pair_scores): bf16 key
  // (and rope) rows of unit stride, whole pair words on each side of the join, on a pair set with
  // gemm_rows.
  static bool main_keys_in_place(const IndexerKlLossParams& p, const kernels::KernelSet& k) {
    return k.word == kernels::Word::kBf16Pair && k.gemm_rows != nullptr && p.head_dim % 2 == 0 &&
           p.rope_dim % 2 == 0 && p.key.sd == 1 && (p.rope_dim == 0 || p.key_rope.sd == 1);
  }

  // Blocks of 64 query rows in a key head's group.
  int64_t q_chunks() const { return (g_ + kKeyTile - 1) / kKeyTile; }

  // The main scores of key head kh's query rows against the chunk's m selected keys (from c0),
  // on bf16 pairs, into sc.s.
  void pair_scores(Scratch& sc, const Sequence& s, int64_t kh, int64_t c0, int64_t m) const {
    if (keys_in_place_) {
      // The rows where they lie (sparse::gathered_product).
      const void* rows[2][kKeyTile];
      for (int64_t c = 0; c < m; ++c) {
        const int64_t j = sc.keys[c0 + c];
        rows[0][c] = static_cast<const uint16_t*>(p_.key.data) + key_row(p_.key, s, j, kh);
        rows[1][c] = p_.rope_dim > 0 ? static_cast<const uint16_t*>(p_.key_rope.data) +
                                           key_row(p_.key_rope, s, j, kh)
                                     : nullptr;
      }
      const uint32_t* qt = sc.qt.data() + kh * q_chunks() * dmw_ * kKeyTile;
      const sparse::GatheredPart parts[2] = {
          {rows[0], p_.head_dim / 2, qt},
          {rows[1], p_.rope_dim / 2, qt + p_.head_dim / 2 * kKeyTile}};
      sparse::gathered_product(kb_, parts, p_.rope_dim > 0 ? 2 : 1, m, g_, dmw_ * kKeyTile,
                               p_.scale, sc.st.data(), sc.ones.data(), sc.s.data());
      return;
    }
    const char* rows[kKeyTile];
    each_chunk_key(sc, s, kh, c0, m, [&](int64_t c, int64_t j) {
      uint32_t* words = sc.kstage.data() + c * dmw_;
      std::fill(words, words + dmw_, 0u);
      joined_bf16(
          p_.key, p_.key_rope, [&](const View& v) { return key_row(v, s, j, kh); },
          reinterpret_cast<uint16_t*>(words));
      rows[c] = reinterpret_cast<const char*>(words);
    });
    kb_.pack_keys(rows, m, dmw_, sc.ktp.data());
    kb_.gemm({sc.qp.data() + kh * g_ * dmw_, dmw_, sc.ktp.data(), kKeyTile, sc.s.data(), kKeyTile,
              g_, kKeyTile, dmw_, nullptr, p_.scale});
  }

  // Adds P of the chunk's m selected keys (from c0) into sc.prob.
  void target_chunk(Scratch& sc, const Sequence& s, int64_t c0, int64_t m) const {
    const char* rows[kKeyTile];
    for (int64_t kh = 0; kh < p_.heads_k; ++kh) {
      if (pairs_) {
        pair_scores(sc, s, kh, c0, m);
        finish_target(sc, kh, c0, m);
        continue;
      }
      each_chunk_key(sc, s, kh, c0, m, [&](int64_t c, int64_t j) {
        float* k = sc.krow.data() + c * dmp_;
        load(p_.key, key_row(p_.key, s, j, kh), p_.head_dim, k);
        if (p_.rope_dim > 0) {
          load(p_.key_rope, key_row(p_.key_rope, s, j, kh), p_.rope_dim, k + p_.head_dim);
        }
        std::fill(k + dm_, k + dmp_, 0.0f);
        rows[c] = reinterpret_cast<const char*>(k);
      });
      k_.pack_keys(rows, m, dmp_, sc.kt.data());
      float* sv = sc.s.data();
      k_.gemm({sc.q.data() + kh * g_ * dmp_, dmp_, sc.kt.data(), kKeyTile, sv, kKeyTile, g_,
               kKeyTile, dmp_, nullptr, p_.scale});
      finish_target(sc, kh, c0, m);
    }
  }

  // The scores in sc.s (key head kh, m keys from c0) to probabilities, summed into sc.prob.
  void finish_target(Scratch& sc, int64_t kh, int64_t c0, int64_t m) const {
    float* sv = sc.s.data();
    for (int64_t r = 0; r < g_; ++r) {
      std::fill(sv + r * kKeyTile + m, sv + (r + 1) * kKeyTile, -kInf);
    }
    k_.exp_rows(sv, g_, kKeyTile, sc.lse.data() + kh * g_);
    float* prob = sc.prob.data() + c0;
    for (int64_t r = 0; r < g_; ++r) k_.rows.add_into(prob, sv + r * kKeyTile, m);
  }

  // bf16 when the index query and key are, float32 otherwise.
  static DType index_dtype(const IndexerKlLossParams& p) {
    const bool bf16 =
        p.query_index.dtype == DType::kBFloat16 && p.key_index.dtype == DType::kBFloat16;
    return bf16 ? DType::kBFloat16 : DType::kFloat32;
  }

  // bf16 when the main query and key (and their rope parts) are, float32 otherwise.
  static DType main_dtype(const IndexerKlLossParams& p) {
    const bool bf16 = p.query.dtype == DType::kBFloat16 && p.key.dtype == DType::kBFloat16 &&
                      (p.rope_dim == 0 || (p.query_rope.dtype == DType::kBFloat16 &&
                                           p.key_rope.dtype == DType::kBFloat16));
    return bf16 ? DType::kBFloat16 : DType::kFloat32;
  }

  // The index scores of group g over the row's nk selected keys into sc.sidx [ig][padded], and
  // I into sc.score.
  void index_scores(Scratch& sc, const Sequence& s, int64_t g, int64_t nk, int64_t padded) const {
    sc.sidx.grow(ig_ * padded);  // every chunk's product writes its 64 columns
    sc.score.assign(padded, 0.0f);
    // The row's index key rows, kept for d_query_index (rows past nk zero): float32 rows, or
    // key pairs on pairs (index_product writes each chunk's whole 64 rows).
    if (ipairs_) {
      sc.key_pairs.grow(padded * dip_);
    } else {
      sc.row_keys.resize(padded * dip_);
      std::fill(sc.row_keys.begin() + nk * dip_, sc.row_keys.end(), 0.0f);
    }
    const float* w = sc.w.data() + g * ig_;
    for (int64_t c0 = 0; c0 < nk; c0 += kKeyTile) {
      const int64_t m = std::min(kKeyTile, nk - c0);
      const char* next[kKeyTile];
      kernels::LinesAhead ahead =
          next_rows(p_.key_index, p_.index_dim, sc, s, c0 + m, g, kKeyTile, next);
      if (ipairs_) {
        index_product(sc, s, g, sc.keys.data() + c0, m, sc.sidx.data() + c0, padded,
                      sc.key_pairs.data() + c0 * dip_, ahead);
      } else {
        const char* rows[kKeyTile];
        for (int64_t c = 0; c < m; ++c) {
          ahead.next();
          float* k = sc.row_keys.data() + (c0 + c) * dip_;
          load_index_key(s, sc.keys[c0 + c], g, k);
          rows[c] = reinterpret_cast<const char*>(k);
        }
        k_.pack_keys(rows, m, dip_, sc.kit.data());
        k_.gemm({sc.qi.data() + g * ig_ * dip_, dip_, sc.kit.data(), kKeyTile, sc.sidx.data() + c0,
                 padded, ig_, kKeyTile, dip_, nullptr, 1.0f});
      }
      for (int64_t h = 0; h < ig_; ++h) {
        k_.rows.relu_axpy(w[h], sc.sidx.data() + h * padded + c0, sc.score.data() + c0);
      }
    }
  }

  double group_pass(Scratch& sc, const Sequence& s, int64_t i, int64_t g, int64_t nk,
                    int64_t padded, double z) {
    index_scores(sc, s, g, nk, padded);
    const float* score = sc.score.data();
    float top = -kInf;
    for (int64_t c = 0; c < nk; ++c) top = std::max(top, score[c]);
    double sum = 0.0;
    for (int64_t c = 0; c < nk; ++c) sum += std::exp(static_cast<double>(score[c]) - top);
    const double lse = top + std::log(sum);
    const double inv = 1.0 / z;
    double loss = 0.0;
    sc.dsc.assign(padded, 0.0f);
    const int64_t drow = token(s, i) * p_.index_heads_k + g;
    float* kept = d_index_.data() + drow * sp_.sparse_count;
    for (int64_t c = 0; c < nk; ++c) {
      const double phat = sc.prob[c] * inv;
      const double logq = score[c] - lse;
      if (phat > 0.0) loss += phat * (std::log(phat) - logq);
      const float d = static_cast<float>(std::exp(logq) - phat);
      sc.dsc[c] = d;
      kept[sc.entries[c]] = d;
    }
    if (keep_signs_) keep_signs(sc, drow, nk, padded);
    if (!std::isfinite(top)) loss += std::numeric_limits<double>::quiet_NaN();
    active_[drow] = 1;
    // d_weights[h] = sum dI relu(S_h); d_query_index[h] = w_h sum dI [S_h > 0] ki: per chunk
    // the coefficients and the weights' partial sums in one pass, then the product.
    const float* w = sc.w.data() + g * ig_;
    std::fill(sc.dw.begin(), sc.dw.end(), 0.0);
    float* acc = sc.acc.data();
    if (ipairs_) {
      // Each head's row holds every chunk's 64 words, 32 of bf16(coef) and 32 of its residual,
      // against the row's key pairs (each chunk's 32 pairs twice): one product over the row.
      sc.coef16.grow((round_up(ig_, 16) + 16) * 2 * padded);
      for (int64_t c0 = 0; c0 < nk; c0 += kKeyTile) {
        for (int64_t h = 0; h < ig_; ++h) {
          float part = 0.0f;
          ki_.rows.coefficient_halves(sc.sidx.data() + h * padded + c0, sc.dsc.data() + c0, w[h],
                                      sc.coef16.data() + (h * padded + c0) * 2, &part);
          sc.dw[h] += part;
        }
      }
      ki_.gemm({sc.coef16.data(), padded, sc.key_pairs.data(), dip_, acc, dip_, ig_, dip_, padded,
                nullptr, 1.0f});
      store_group(sc, s, i, g);
      return loss;
    }
    std::fill(acc, acc + ig_ * dip_, 0.0f);
    float* coef = sc.coef.data();
    float* unused = sc.s.data();  // split_coefficients' second output, not read
    for (int64_t c0 = 0; c0 < nk; c0 += kKeyTile) {
      const float* d = sc.dsc.data() + c0;
      for (int64_t h = 0; h < ig_; ++h) {
        float part = 0.0f, ignored = 0.0f;
        k_.rows.split_coefficients(sc.sidx.data() + h * padded + c0, d, d, w[h],
                                   coef + h * kKeyTile, unused, &part, &ignored);
        sc.dw[h] += part;
      }
      k_.gemm({coef, kKeyTile, sc.row_keys.data() + c0 * dip_, dip_, acc, dip_, ig_, dip_, kKeyTile,
               sc.ones.data(), 1.0f});
    }
    store_group(sc, s, i, g);
    return loss;
  }

  // The signs of the group's index scores (sc.sidx) of the row's nk selected keys, at their
  // entries of row drow.
  void keep_signs(Scratch& sc, int64_t drow, int64_t nk, int64_t padded) {
    // Byte b of key c holds heads 8b..8b+7 (bit h % 8): per 64 heads a word per key, whose
    // little-endian bytes are those bytes, copied to the keys' entries.
    sc.sign_words.resize(padded);
    uint8_t* out = signs_.data() + drow * sp_.sparse_count * sign_width_;
    for (int64_t h0 = 0; h0 < ig_; h0 += kKeyTile) {
      const int64_t heads = std::min(kKeyTile, ig_ - h0);
      k_.rows.sign_words(sc.sidx.data() + h0 * padded, padded, heads, nk, sc.sign_words.data());
      const size_t bytes = static_cast<size_t>((heads + 7) / 8);
      for (int64_t c = 0; c < nk; ++c) {
        std::memcpy(out + sc.entries[c] * sign_width_ + h0 / 8, &sc.sign_words[c], bytes);
      }
    }
  }

  // Writes d_query_index (sc.acc) and d_weights (sc.dw) of group g of token i.
  void store_group(Scratch& sc, const Sequence& s, int64_t i, int64_t g) const {
    const KlGradient& dq = p_.d_query_index;
    const KlGradient& dw = p_.d_weights;
    for (int64_t r = 0; r < ig_; ++r) {
      const int64_t h = g * ig_ + r;
      store_row(k_, dq.data, dq.dtype, query_row(dq, s, i, h), dq.sd, p_.index_dim,
                sc.acc.data() + r * dip_, 1.0f);
      const float v = static_cast<float>(sc.dw[r]);
      store_row(k_, dw.data, dw.dtype, query_row(dw, s, i, h), 1, 1, &v, 1.0f);
    }
  }

  const SparseKlLossParams& sp_;
  const IndexerKlLossParams& p_;
  const kernels::KernelSet& k_;
  const kernels::KernelSet& kb_;  // the main score product's kernels: k_, or bf16 pairs
  bool pairs_;
  const kernels::KernelSet& ki_;  // the index products' kernels: k_, or bf16 pairs
  bool ipairs_;
  Mask mask_;
  std::vector<Sequence> seqs_;
  int64_t g_, ig_;
  int64_t ig_t_;  // row stride of the transposed coefficients
  int64_t dm_, dmp_, dip_;
  int64_t dmw_;         // pair words per main row, padded to kb_'s depth_align
  int64_t diw_;         // pair words per index row, padded to ki_'s depth_align
  int64_t head_pairs_;  // rows of qih: ig rounded up to whole blocks of 64 heads
  int64_t sign_width_;  // bytes of one entry's signs: a bit per head of a group
  bool keys_in_place_;  // main_keys_in_place
  // The index products read the selected index key rows where they lie: bf16 pairs of unit
  // stride that fill their pair words (no padding to the set's depth).
  bool index_keys_in_place_;
  std::vector<uint8_t> active_;  // [rows][N2index]: the row had target mass
  bool keep_signs_;              // the first pass keeps the signs (within the budget)
  // [rows][N2index][K][sign_width_]: bit h of entry e is index score h > 0
  AlignedBuffer<uint8_t> signs_;
  AlignedBuffer<float> d_index_;  // [rows][N2index][K]: dI per selection entry
};

}  // namespace

void validate(const SparseKlLossParams& p) {
  validate(p.dense, false);
  const IndexerKlLossParams& d = p.dense;
  if (p.sparse_count < 0) throw ArgumentError("sparse_indices", "negative K");
  if (p.index_heads != 1 && p.index_heads != d.index_heads_k) {
    throw ArgumentError("sparse_indices", "key-head dim must be 1 or N2index=" +
                                              str(d.index_heads_k) + ", got " + str(p.index_heads));
  }
  const std::vector<Sequence> seqs = indexer_sequences(index_params(d));
  if (sequence_work(seqs).queries && p.sparse_count > 0 && p.indices.data == nullptr) {
    throw ArgumentError("sparse_indices", "is null");
  }
  Selection selection;
  selection.indices = p.indices;
  selection.heads = p.index_heads;
  selection.count = p.sparse_count;
  selection.tnd = d.layout == Layout::kTND;
  validate(selection, seqs);
}

void sparse_lightning_indexer_grad_kl_loss(const SparseKlLossParams& p, const Executor& executor,
                                           Isa isa) {
  validate(p);
  require_supported(isa);
  SparseKl run(p, isa);
  const std::vector<Sequence>& seqs = run.sequences();
  if (reads_non_finite(p.dense, seqs, false, executor)) {
    write_non_finite(p.dense, seqs);
    return;
  }
  const int threads = std::max(1, executor.num_workers());
  ScratchPool<SparseKl::Scratch, SparseKl> scratch(run, threads);
  const std::vector<TokenTask> token_tasks = core::token_tasks(seqs, kTokensPerTask);
  std::vector<double> loss(token_tasks.size(), 0.0);
  run_dynamic(executor, static_cast<int64_t>(token_tasks.size()), [&](int64_t t, int thread) {
    SparseKl::Scratch& sc = scratch[thread];
    const kernels::WorkerScope scope(run.kernel_set());
    const TokenTask& task = token_tasks[t];
    double share = 0.0;
    for (int64_t i = task.i0; i < task.i1; ++i) share += run.token_pass(sc, seqs[task.b], i);
    loss[t] = share;
  });
  // Key blocks per (sequence, index key head), two per thread, at least 128 keys each: a token's
  // query rows are loaded once per block it selects keys in, so fewer, longer blocks load less.
  // Under a causal mask early keys are selected far more often than late ones (the first quarter
  // of the keys takes about 60% of the entries), so the blocks share the entries, not the keys.
  const std::vector<KeyTask> key_tasks = core::weighted_key_tasks(
      seqs, p.dense.index_heads_k, 2 * threads, 128,
      [&](const Sequence& s, int64_t g) { return run.selections_per_key(s, g); });
  run_dynamic(executor, static_cast<int64_t>(key_tasks.size()), [&](int64_t t, int thread) {
    const kernels::WorkerScope scope(run.kernel_set());
    const KeyTask& task = key_tasks[t];
    run.key_pass(scratch[thread], seqs[task.b], task.g, task.j0, task.j1);
  });
  double total = 0.0;
  for (double l : loss) total += l;
  *p.dense.loss = static_cast<float>(total);
}

}  // namespace opmesh::core
