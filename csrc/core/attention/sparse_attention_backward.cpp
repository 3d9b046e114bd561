// sparse_flash_attention's backward, deterministic for any executor. The query tokens are taken
// span by span, in order (a span's products kept for its key pass, two spans' worth at a time):
// - the query pass, per token of a span: each head's log-sum-exp (from the statistics and the
//   sink) and delta = dout . out, dq (products over the token's selected keys, 64 at a time, in
//   selection order), the token's share of dsinks, and its selection with P and dS for each
//   selected key (bf16 head pairs, or float32), which the key pass reads;
// - the key pass, per block of keys and span: dk and dv of each key, the sum over the span's
//   tokens that selected it, in token order, added to the sum of the spans before (each block
//   owned by one worker per span, so no two workers add into one row), from the kept P and dS;
//   the key pass of a span runs beside the query pass of the next;
// - dsinks: the tokens' shares summed in token order.
// Five products per selected key and head (S, dP, dq, dk, dv): P and dS are made once. Where the
// query and output-gradient rows are read in place, each pass asks for the rows of its next token
// from memory during the current token's products (a share in each product call).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <vector>

#include "../aligned_buffer.h"
#include "../errors.h"
#include "../kernels/kernel_set.h"
#include "../work_split.h"
#include "sparse_attention.h"
#include "sparse_attention_detail.h"

namespace opmesh::core {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kTokensPerTask = 8;
// A span of query tokens: at most this many tokens, and its kept products within this many bytes
// (or one token). Each span's key pass sweeps the sums of every key block its tokens reach, so
// longer spans sweep them fewer times (DSA, 8 heads of 64, S = 131072, K = 2048: 1024-token spans
// 39 s forward + backward, 256-token spans 41-44 s).
constexpr int64_t kSpanTokens = 1024;
constexpr int64_t kSpanBytes = int64_t{64} << 20;

using kernels::kKeyTile;
using kernels::round_up;

// a . b over n entries: entry e adds into running sum e % 16 (in order), and the 16 sums are
// added pairwise at the end. Fixed bits, and a loop the compiler can run on vectors (one sum,
// entry after entry, waits on each add: 35 us a token of 64 heads x 512).
float dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {};
  int64_t e = 0;
  for (; e + 16 <= n; e += 16) {
    for (int l = 0; l < 16; ++l) acc[l] += a[e + l] * b[e + l];
  }
  for (int l = 0; e + l < n; ++l) acc[l] += a[e + l] * b[e + l];
  for (int w = 8; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

// Heads one product of the key pass takes as its depth on bf16 pairs: 64 pair words, the width
// of a transposed tile.
constexpr int64_t kPairHeads = 2 * kKeyTile;

// One key of a kept selection: its source and position.
struct KeptKey {
  int32_t source;
  int32_t j;
};

// What the query pass of a span keeps for its key pass. The selections of the span's tokens and
// key heads follow one another, in order; entry e is one selected key (keys[e]) with its P and
// dS over the group's heads (words[e][2][kept_words]).
struct SpanStore {
  int64_t base = 0;  // the number of entries before the span's
  std::vector<KeptKey> keys;
  AlignedBuffer<uint32_t> words;
};

class Backward {
 public:
  Backward(const SparseAttentionParams& p, const SparseAttentionGrads& gr,
           const sparse::KeySelector& keys, Isa isa)
      : p_(p),
        gr_(gr),
        geo_(p),
        keys_(keys),
        k_(kernels::select_set(isa, p.dtype, -1, true)),
        pairs_(k_.word == kernels::Word::kBf16Pair),
        g_(geo_.groups()),
        dqk_(p.head_dim + p.rope_dim),
        dq16_(round_up(dqk_, 16)),
        dv16_(round_up(p.value_dim, 16)),
        rows_(round_up(g_, pairs_ ? std::max<int64_t>(2, k_.row_align) : k_.row_align)),
        dw_(pairs_ ? round_up((dqk_ + 1) / 2, k_.depth_align) : dq16_),
        dwv_(pairs_ ? round_up((p.value_dim + 1) / 2, k_.depth_align) : dv16_),
        head_pairs_(pairs_ ? round_up((g_ + 1) / 2, kKeyTile) : 0),
        kept_words_(pairs_ ? (g_ - 1) / kPairHeads * kPairHeads / 2 +
                                 block_depth((g_ - 1) / kPairHeads * kPairHeads)
                           : g_),
        direct_(pairs_ && sparse::rows_in_place(p, keys, k_, 2)),
        queries_in_place_(direct_ && p.rope_dim == 0 && 2 * dw_ == p.head_dim &&
                          2 * dwv_ == p.value_dim && sparse::words_in_place(p.query, p.head_dim) &&
                          sparse::words_in_place(gr.dout, p.value_dim)),
        dq_rows_(direct_ && k_.value_rows != nullptr && p.head_dim % 32 == 0 &&
                 p.rope_dim % 32 == 0) {
    const int64_t rows = p.layout_query == Layout::kTND ? p.seq_q : p.batch * p.seq_q;
    if (p.sinks != nullptr) sink_share_.assign(rows * p.heads_q, 0.0f);
    for (int i = 0; i < keys.num_sources(); ++i) sources_.push_back(&keys.source(i));
  }

  // Blocks of 64 heads in the group (transposed rows of gathered_product's B operands).
  int64_t chunks() const { return (g_ + kKeyTile - 1) / kKeyTile; }

  const kernels::KernelSet& kernel_set() const { return k_; }

  // Rows asked for from memory while a token's products run (the next token's, read in place),
  // an even share of them in each of `parts` calls: part(k) is the share of call k.
  struct Shares {
    kernels::RowsAhead rows;
    int64_t parts = 1;
    kernels::RowsAhead part(int64_t k) const { return kernels::share(rows, k, parts); }
  };

  // One worker's buffers: O(G x (64 + D + Dr + Dv) + 64 x (D + Dr + Dv)), whatever the sequence
  // lengths. With bf16 pairs the word buffers hold pairs: query, output-gradient, key and value
  // rows along their head dims (q, dout, krow, vrow), keys and values transposed (kt, vt), keys
  // as key pairs (kp), and queries and output gradients as head pairs (qh, oh).
  struct Scratch {
    explicit Scratch(const Backward& b)
        : q(b.rows_ * b.dw_),
          dout(b.rows_ * b.dwv_),
          acc(std::max(b.rows_ * b.dq16_, kKeyTile * std::max(b.dq16_, b.dv16_))),
          acc2(b.pairs_ ? kKeyTile * std::max(b.dq16_, b.dv16_) : 0),
          krow(kKeyTile * b.dw_),
          vrow(kKeyTile * b.dwv_),
          kt(b.dw_ * kKeyTile),
          vt(b.dwv_ * kKeyTile),
          kp(b.pairs_ ? kKeyTile / 2 * b.dq16_ : 0),
          qh(b.head_pairs_ * b.dq16_),
          oh(b.head_pairs_ * b.dv16_),
          s(b.rows_ * kKeyTile),
          dp(b.rows_ * kKeyTile),
          cap(b.p_.softcap > 0.0f ? b.rows_ * kKeyTile : 0),
          pt(kKeyTile * std::max({b.g_, b.kept_words_, kKeyTile})),
          dst(kKeyTile * std::max({b.g_, b.kept_words_, kKeyTile})),
          ds16(b.pairs_ ? b.rows_ * kKeyTile : 0),
          words(b.pairs_ ? kKeyTile * kKeyTile : 0),
          ones(std::max<int64_t>(b.rows_, kKeyTile), 1.0f),
          lse(b.g_),
          delta(b.g_),
          row(std::max(b.dqk_, b.p_.value_dim)),
          row2(b.p_.value_dim),
          token_rows(3 * b.g_),
          qt(b.direct_ ? b.chunks() * b.dw_ * kKeyTile : 0),
          ot(b.direct_ ? b.chunks() * b.dwv_ * kKeyTile : 0),
          st(b.direct_ ? kKeyTile * round_up(b.g_, 16) : 0) {}
    AlignedBuffer<uint32_t> q;      // [rows][dw] query rows (query | rope)
    AlignedBuffer<uint32_t> dout;   // [rows][dwv]
    AlignedBuffer<float> acc;       // pass 1: dq [rows][dq16]; pass 2: a product's [64][dq16|dv16]
    AlignedBuffer<float> acc2;      // pass 2 on pairs: the other product
    AlignedBuffer<uint32_t> krow;   // [64][dw] selected key rows (key | rope)
    AlignedBuffer<uint32_t> vrow;   // [64][dwv] selected value rows
    AlignedBuffer<uint32_t> kt;     // [dw][64] keys transposed
    AlignedBuffer<uint32_t> vt;     // [dwv][64] values transposed
    AlignedBuffer<uint32_t> kp;     // [32][dq16] keys as key pairs (pairs)
    AlignedBuffer<uint32_t> qh;     // [head pairs][dq16] queries as head pairs (pairs)
    AlignedBuffer<uint32_t> oh;     // [head pairs][dv16] output gradients as head pairs (pairs)
    AlignedBuffer<float> s;         // [rows][64] scores, then probabilities
    AlignedBuffer<float> dp;        // [rows][64] dP, then dS
    AlignedBuffer<float> cap;       // [rows][64] the softcap's derivative (softcap only)
    AlignedBuffer<uint32_t> pt;     // [64][64] P as head pairs (pairs); [64][kept] kept P rows
    AlignedBuffer<uint32_t> dst;    // the same of dS
    AlignedBuffer<uint16_t> ds16;   // [rows][64] dS in bf16, as key pairs (pairs)
    AlignedBuffer<uint32_t> words;  // [64][64] head-pair rows before their transpose (pairs)
    std::vector<float> ones;
    std::vector<float> lse, delta;  // the query pass's token, [G]
    std::vector<float> row, row2;
    std::vector<sparse::KeyRef> keys;
    std::vector<int64_t> hits;            // the key pass: kept entries of one token in a key block
    std::vector<const char*> token_rows;  // both passes: the next token's rows (token_rows())
    // Rows read in place (direct_): the query and output-gradient rows transposed per 64 heads
    // (gathered_product's B operands), and its S^T.
    AlignedBuffer<uint32_t> qt, ot;
    AlignedBuffer<float> st;
  };

  // Counts the entries (token i of s, key head g) keeps: entries_ holds the counts until
  // sum_entries makes them prefix sums.
  void count_entries(Scratch& sc, const Sequence& s, int64_t i, int64_t g) {
    keys_.select(s, i, g, nullptr, sc.keys);
    entries_[slot(s, i, g) + 1] = static_cast<int64_t>(sc.keys.size());
  }

  // Numbers the query tokens of the call in order (positions_: each sequence's first) and sizes
  // entries_ for one count per (token, key head).
  void number_tokens(const std::vector<Sequence>& seqs) {
    positions_.assign(seqs.size(), 0);
    int64_t at = 0;
    for (size_t b = 0; b < seqs.size(); ++b) {
      positions_[b] = at;
      at += seqs[b].q_len;
    }
    entries_.assign(at * p_.heads_k + 1, 0);
  }

  // After count_entries: entries_ from the counts.
  void sum_entries() {
    for (size_t e = 1; e < entries_.size(); ++e) entries_[e] += entries_[e - 1];
  }

  int64_t position(const Sequence& s, int64_t i) const { return positions_[s.batch] + i; }
  int64_t tokens() const { return static_cast<int64_t>(entries_.size() - 1) / p_.heads_k; }

  // Spans of positions [at[u], at[u + 1]): at most kSpanTokens tokens each, their kept entries
  // within kSpanBytes (or one token).
  std::vector<int64_t> spans() const {
    const int64_t entry_bytes = 2 * kept_words_ * 4 + static_cast<int64_t>(sizeof(KeptKey));
    std::vector<int64_t> at = {0};
    int64_t count = 0, bytes = 0;
    for (int64_t t = 0; t < tokens(); ++t) {
      const int64_t b = (entries_[(t + 1) * p_.heads_k] - entries_[t * p_.heads_k]) * entry_bytes;
      if (count > 0 && (count == kSpanTokens || bytes + b > kSpanBytes)) {
        at.push_back(t);
        count = bytes = 0;
      }
      ++count;
      bytes += b;
    }
    if (tokens() > 0) at.push_back(tokens());
    return at;
  }

  // Makes st ready for the query pass of the tokens at positions [t0, t1).
  void open_span(SpanStore& st, int64_t t0, int64_t t1) const {
    st.base = entries_[t0 * p_.heads_k];
    const int64_t n = entries_[t1 * p_.heads_k] - st.base;
    st.keys.resize(n);
    st.words.grow_uninitialized(n * 2 * kept_words_);
  }

  // Writes the token's row of sink_share_ (no other task touches it), its dq
  // (the sum over its selected keys in selection order), and its entries of st: the selection,
  // with P and dS.
  // `more`: whether the worker's task goes on to the next (token, key head), whose rows it asks
  // for meanwhile.
  void query_pass(Scratch& sc, const Sequence& s, int64_t i, int64_t g, SpanStore& st, bool more) {
    load_token(sc, s, i, g, false);
    const int64_t row = geo_.token(s, i) * p_.heads_q + g * g_;
    const int64_t stats = geo_.stats_offset(s, i, g);
    float* lse = sc.lse.data();  // +inf where nothing is selected
    float* delta = sc.delta.data();
    std::fill(lse, lse + g_, kInf);
    for (int64_t r = 0; r < g_; ++r) {
      const int64_t h = g * g_ + r;
      sparse::load(k_, gr_.out.data, p_.dtype, geo_.query_offset(gr_.out, s, i, h), gr_.out.sd,
                   p_.value_dim, sc.row.data());
      sparse::load(k_, gr_.dout.data, p_.dtype, geo_.query_offset(gr_.dout, s, i, h), gr_.dout.sd,
                   p_.value_dim, sc.row2.data());
      // A gradient of the log-sum-exp adds dlse * P to dS (dlse * the sink's share to dsinks):
      // dS = P (dP - (delta - dlse)).
      delta[r] = dot(sc.row2.data(), sc.row.data(), p_.value_dim) -
                 (gr_.dlse != nullptr ? gr_.dlse[stats + r] : 0.0f);
      if (gr_.softmax_lse != nullptr) {
        const float given = gr_.softmax_lse[stats + r];
        if (given == -kInf) continue;  // neither a key nor a sink: lse stays +inf
        lse[r] = given;
      } else {
        const float m = gr_.softmax_max[stats + r];
        if (m == -kInf) continue;  // nothing selected: lse stays +inf, no probability anywhere
        const float sink = p_.sinks != nullptr ? std::exp(p_.sinks[h] - m) : 0.0f;
        lse[r] = m + std::log(gr_.softmax_sum[stats + r] + sink);
      }
      if (p_.sinks != nullptr) sink_share_[row + r] = -std::exp(p_.sinks[h] - lse[r]) * delta[r];
    }
    keys_.select(s, i, g, nullptr, sc.keys);
    const int64_t e0 = entries_[slot(s, i, g)] - st.base;
    if (entries_[slot(s, i, g) + 1] - entries_[slot(s, i, g)] !=
        static_cast<int64_t>(sc.keys.size())) {
      throw std::logic_error("sparse backward: a selection changed between its two reads");
    }
    for (size_t c = 0; c < sc.keys.size(); ++c) {
      st.keys[e0 + c] = {sc.keys[c].source, sc.keys[c].j};
    }
    float* dq = sc.acc.data();
    std::fill(dq, dq + g_ * dq16_, 0.0f);
    // The next group's output, output-gradient and query rows, asked for during the products:
    // each chunk's two products and its calls of dq_from_rows take a part each.
    const int64_t chunks = (static_cast<int64_t>(sc.keys.size()) + kKeyTile - 1) / kKeyTile;
    const int64_t parts = 2 + (dq_rows_ ? (g_ + 7) / 8 : 0);
    const int64_t ni = g + 1 < p_.heads_k ? i : i + 1;
    const Shares next = token_rows(sc, s, more ? ni : -1, (g + 1) % p_.heads_k, 3, chunks * parts);
    for (size_t c0 = 0; c0 < sc.keys.size(); c0 += kKeyTile) {
      const int64_t n = std::min<int64_t>(kKeyTile, sc.keys.size() - c0);
      const int64_t part = static_cast<int64_t>(c0) / kKeyTile * parts;
      probabilities(sc, sc.keys.data() + c0, n, next_chunk(sc.keys, c0 + n), lse, delta, next,
                    part);
      keep(sc, n, st.words.data() + (e0 + c0) * 2 * kept_words_);
      // dq += dS K (float32: scale dS K)
      if (pairs_) k_.to_bf16(sc.dp.data(), sc.ds16.data(), rows_ * kKeyTile);
      if (dq_rows_) {
        dq_from_rows(sc, sc.keys.data() + c0, n, dq, next, part + 2);
      } else if (pairs_) {
        k_.gemm({sc.ds16.data(), kKeyTile / 2, sc.kp.data(), dq16_, dq, dq16_, g_, dq16_,
                 kKeyTile / 2, sc.ones.data(), 1.0f});
      } else {
        k_.gemm({sc.dp.data(), kKeyTile, sc.krow.data(), dq16_, dq, dq16_, g_, dq16_, kKeyTile,
                 sc.ones.data(), p_.scale});
      }
    }
    // On pairs dS K is summed unscaled (the same bits from the rows in place and packed).
    const float scale = pairs_ ? p_.scale : 1.0f;
    for (int64_t r = 0; r < g_; ++r) {
      const int64_t out = geo_.token(s, i) * p_.heads_q + g * g_ + r;
      store_row(k_, gr_.dq, p_.dtype, out * p_.head_dim, 1, p_.head_dim, dq + r * dq16_, scale);
      if (p_.rope_dim > 0) {
        store_row(k_, gr_.dq_rope, p_.dtype, out * p_.rope_dim, 1, p_.rope_dim,
                  dq + r * dq16_ + p_.head_dim, scale);
      }
    }
  }

  // Adds into grads (dk [j1 - j0][dq16] without the scale, then dv [j1 - j0][dv16]) the
  // gradients of keys [j0, j1) of source k, key head g, from the tokens [i0, i1) of s (its
  // queries, all in st's span) that select them, in token order, from the P and dS st keeps.
  void key_pass(Scratch& sc, int k, const Sequence& s, int64_t g, int64_t j0, int64_t j1,
                int64_t i0, int64_t i1, float* grads, const SpanStore& st) const {
    float* dk = grads;
    float* dv = grads + (j1 - j0) * dq16_;
    for (int64_t i = i0; i < i1; ++i) {
      if (!keys_.may_select(s, i, k, j0, j1)) continue;
      // The token's selection in the block, in selection order.
      sc.hits.clear();
      const int64_t e1 = entries_[slot(s, i, g) + 1] - st.base;
      for (int64_t e = entries_[slot(s, i, g)] - st.base; e < e1; ++e) {
        const KeptKey& key = st.keys[e];
        if (key.source == k && key.j >= j0 && key.j < j1) sc.hits.push_back(e);
      }
      if (sc.hits.empty()) continue;
      load_token(sc, s, i, g, true);
      // The next token's output-gradient and query rows, asked for during this token's
      // products: two per chunk.
      const bool ahead = i + 1 < i1 && keys_.may_select(s, i + 1, k, j0, j1);
      const int64_t chunks = (static_cast<int64_t>(sc.hits.size()) + kKeyTile - 1) / kKeyTile;
      const Shares next = token_rows(sc, s, ahead ? i + 1 : -1, g, 2, 2 * chunks);
      for (size_t c0 = 0; c0 < sc.hits.size(); c0 += kKeyTile) {
        const int64_t n = std::min<int64_t>(kKeyTile, sc.hits.size() - c0);
        const int64_t* hits = sc.hits.data() + c0;
        const int64_t part = 2 * (static_cast<int64_t>(c0) / kKeyTile);
        // The chunk's kept P and dS rows, gathered.
        for (int64_t c = 0; c < n; ++c) {
          const uint32_t* kept = st.words.data() + hits[c] * 2 * kept_words_;
          std::memcpy(sc.pt.data() + c * kept_words_, kept, kept_words_ * sizeof(uint32_t));
          std::memcpy(sc.dst.data() + c * kept_words_, kept + kept_words_,
                      kept_words_ * sizeof(uint32_t));
        }
        // dV rows += P^T dout; dK rows += dS^T Q (store_keys applies the scale). Keys at
        // consecutive positions on one product of heads: the products add into their rows, the
        // same bits as adding a product's rows.
        const int64_t first = st.keys[hits[0]].j;
        bool consecutive = true;
        for (int64_t c = 1; c < n; ++c) consecutive &= st.keys[hits[c]].j == first + c;
        if (pairs_ && g_ <= kPairHeads && consecutive) {
          pair_key_products(sc, n, dv + (first - j0) * dv16_, dk + (first - j0) * dq16_, true, next,
                            part);
          continue;
        }
        const float* tv = sc.acc.data();
        const float* tk = pairs_ ? sc.acc2.data() : sc.acc.data();
        if (pairs_) {
          pair_key_products(sc, n, sc.acc.data(), sc.acc2.data(), false, next, part);
        } else {
          float_key_product(sc, sc.pt.data(), sc.dout.data(), dv16_, n);
        }
        for (int64_t c = 0; c < n; ++c) {
          k_.rows.add_into(dv + (st.keys[hits[c]].j - j0) * dv16_, tv + c * dv16_, p_.value_dim);
        }
        if (!pairs_) float_key_product(sc, sc.dst.data(), sc.q.data(), dq16_, n);
        for (int64_t c = 0; c < n; ++c) {
          k_.rows.add_into(dk + (st.keys[hits[c]].j - j0) * dq16_, tk + c * dq16_, dqk_);
        }
      }
    }
  }

  // Floats of one key's dk and dv rows in key_pass's grads.
  int64_t key_row_floats() const { return dq16_ + dv16_; }

  // Stores the gradients of keys [j0, j1) of source k's sequence ks, key head g, from key_pass's
  // grads: dk times the scale (made in grads).
  void store_keys(int k, const Sequence& ks, int64_t g, int64_t j0, int64_t j1,
                  float* grads) const {
    const int64_t n = j1 - j0;
    float* dk = grads;
    const float* dv = grads + n * dq16_;
    for (int64_t e = 0; e < n * dq16_; ++e) dk[e] *= p_.scale;
    for (int64_t j = j0; j < j1; ++j) {
      keys_.store_grads(k_, k, ks, j, g, dk + (j - j0) * dq16_, dv + (j - j0) * dv16_);
    }
  }

  // dsinks: every row's share, summed in row order. A row no task reaches (past a used length)
  // holds the sink alone, its lse the sink itself (the forward's), so its share is its dlse.
  void finish_sinks(const std::vector<Sequence>& seqs) {
    if (gr_.dsinks == nullptr) return;
    std::fill(gr_.dsinks, gr_.dsinks + p_.heads_q, 0.0f);
    if (p_.sinks == nullptr) return;
    const int64_t rows = static_cast<int64_t>(sink_share_.size()) / p_.heads_q;
    if (gr_.dlse != nullptr) {
      std::vector<bool> reached(rows, false);
      for (const sparse::RowSpan& w : sparse::written_rows(seqs, p_.layout_query, p_.seq_q, false))
        std::fill(reached.begin() + w.begin, reached.begin() + w.begin + w.count, true);
      for (int64_t t = 0; t < rows; ++t) {
        if (reached[t]) continue;
        const bool tnd = p_.layout_query == Layout::kTND;
        const int64_t b = tnd ? 0 : t / p_.seq_q;
        const int64_t i = tnd ? t : t % p_.seq_q;
        for (int64_t h = 0; h < p_.heads_q; ++h) {
          const int64_t g = h / g_;
          sink_share_[t * p_.heads_q + h] =
              gr_.dlse[((b * p_.heads_k + g) * p_.seq_q + i) * g_ + h % g_];
        }
      }
    }
    std::vector<double> sum(p_.heads_q, 0.0);
    for (int64_t t = 0; t < rows; ++t) {
      for (int64_t h = 0; h < p_.heads_q; ++h) sum[h] += sink_share_[t * p_.heads_q + h];
    }
    for (int64_t h = 0; h < p_.heads_q; ++h) gr_.dsinks[h] = static_cast<float>(sum[h]);
  }

 private:
  int64_t slot(const Sequence& s, int64_t i, int64_t g) const {
    return position(s, i) * p_.heads_k + g;
  }

  // The depth of a key pass product of the heads from h0 on bf16 pairs (up to kPairHeads of them).
  int64_t block_depth(int64_t h0) const {
    return round_up((std::min(kPairHeads, g_ - h0) + 1) / 2, k_.depth_align);
  }

  // xt[c][l] = (x[h0 + 2l][c], x[h0 + 2l + 1][c]) for the heads from h0 (up to kPairHeads), ld 64,
  // x [rows][64]: rows past G are zero.
  void head_pairs(Scratch& sc, const float* x, int64_t h0, uint32_t* xt) const {
    const int64_t pairs = (std::min(kPairHeads, g_ - h0) + 1) / 2;
    const char* rows[kKeyTile];
    for (int64_t l = 0; l < kKeyTile; ++l) {
      rows[l] = reinterpret_cast<const char*>(sc.words.data() + l * kKeyTile);
    }
    for (int64_t l = 0; l < pairs; ++l) {
      k_.rows.pair_rows(x + (h0 + 2 * l) * kKeyTile, x + (h0 + 2 * l + 1) * kKeyTile,
                        sc.words.data() + l * kKeyTile);
    }
    k_.pack_keys(rows, pairs, kKeyTile, xt);
  }

  // Keeps P and dS of a chunk's n keys (sc.s, sc.dp) for the key pass: `out` row c (2 kept_words_
  // words apart) holds key c's P over the group's heads, then its dS, as head pairs on pairs
  // (each block of kPairHeads heads from word h0 / 2, zero-padded to its product's depth), as
  // floats otherwise.
  void keep(Scratch& sc, int64_t n, uint32_t* out) const {
    const int64_t ld = 2 * kept_words_;
    if (!pairs_) {
      const float* sv = sc.s.data();
      const float* dp = sc.dp.data();
      for (int64_t c = 0; c < n; ++c) {
        float* row = reinterpret_cast<float*>(out + c * ld);
        for (int64_t r = 0; r < g_; ++r) {
          row[r] = sv[r * kKeyTile + c];
          row[kept_words_ + r] = dp[r * kKeyTile + c];
        }
      }
      return;
    }
    for (int64_t h0 = 0; h0 < g_; h0 += kPairHeads) {
      const size_t bytes = block_depth(h0) * sizeof(uint32_t);
      head_pairs(sc, sc.s.data(), h0, sc.pt.data());
      head_pairs(sc, sc.dp.data(), h0, sc.dst.data());
      for (int64_t c = 0; c < n; ++c) {
        std::memcpy(out + c * ld + h0 / 2, sc.pt.data() + c * kKeyTile, bytes);
        std::memcpy(out + c * ld + kept_words_ + h0 / 2, sc.dst.data() + c * kKeyTile, bytes);
      }
    }
  }

  // Float32: acc[c][e] = sum_r xt[c][r] y[r][e] for the n keys c of a chunk, xt their kept P (or
  // dS) rows and y [G][ld] rows (dout or q).
  void float_key_product(Scratch& sc, const uint32_t* xt, const uint32_t* y, int64_t ld,
                         int64_t n) const {
    k_.gemm({xt, kept_words_, y, ld, sc.acc.data(), ld, n, ld, g_, nullptr, 1.0f});
  }

  // bf16 pairs: dv = P^T dout and dk = dS^T Q ([n][dv16], [n][dq16]) for the n keys of a chunk
  // from their kept rows (sc.pt, sc.dst), the heads as the depth in pairs, up to kPairHeads heads
  // a product (later ones add to the first); with `add`, the first adds too.
  // `ahead`: parts `part` and `part` + 1 of it asked for during the two products of the first
  // heads.
  void pair_key_products(Scratch& sc, int64_t n, float* dv, float* dk, bool add,
                         const Shares& ahead, int64_t part) const {
    for (int64_t h0 = 0; h0 < g_; h0 += kPairHeads) {
      const int64_t depth = block_depth(h0);
      const float* scale_rows = h0 == 0 && !add ? nullptr : sc.ones.data();
      k_.gemm({sc.pt.data() + h0 / 2, kept_words_, sc.oh.data() + h0 / 2 * dv16_, dv16_, dv, dv16_,
               n, dv16_, depth, scale_rows, 1.0f,
               h0 == 0 ? ahead.part(part) : kernels::RowsAhead{}});
      k_.gemm({sc.dst.data() + h0 / 2, kept_words_, sc.qh.data() + h0 / 2 * dq16_, dq16_, dk, dq16_,
               n, dq16_, depth, scale_rows, 1.0f,
               h0 == 0 ? ahead.part(part + 1) : kernels::RowsAhead{}});
    }
  }

  // Token i's rows of group g read in place, as Shares of `parts` parts: its output-gradient
  // rows, then (kinds 2 and 3) its query rows, then (kind 3) its output rows, in sc.token_rows.
  // None when the rows are copied, or for i < 0.
  Shares token_rows(Scratch& sc, const Sequence& s, int64_t i, int64_t g, int kinds,
                    int64_t parts) const {
    if (!queries_in_place_ || i < 0) return {};
    const View* views[3] = {&gr_.dout, &p_.query, &gr_.out};
    for (int v = 0; v < kinds; ++v) {
      const char* base = static_cast<const char*>(views[v]->data);
      for (int64_t r = 0; r < g_; ++r) {
        sc.token_rows[v * g_ + r] = base + 2 * geo_.query_offset(*views[v], s, i, g * g_ + r);
      }
    }
    return {{sc.token_rows.data(), kinds * g_, 2 * std::max(p_.head_dim, p_.value_dim)}, parts};
  }

  // Query rows (query | rope) and dout rows of token i's group g, zero-padded, as float32 rows
  // of dq16 / dv16 or as bf16 pairs of dw / dwv words; for the query pass reading keys in place
  // (direct_) transposed too; for the key pass (`heads`) on pairs as head pairs (the depth of its
  // products).
  void load_token(Scratch& sc, const Sequence& s, int64_t i, int64_t g, bool heads) const {
    // The rows as pair words, ld apart: where they lie, or copied (and zero-padded) into sc.
    const uint32_t* q = sc.q.data();
    const uint32_t* o = sc.dout.data();
    int64_t ldq = dw_, ldo = dwv_;
    if (queries_in_place_) {
      q = static_cast<const uint32_t*>(p_.query.data) +
          geo_.query_offset(p_.query, s, i, g * g_) / 2;
      o = static_cast<const uint32_t*>(gr_.dout.data) +
          geo_.query_offset(gr_.dout, s, i, g * g_) / 2;
      ldq = p_.query.sn / 2;
      ldo = gr_.dout.sn / 2;
    } else {
      for (int64_t r = 0; r < g_; ++r) {
        const int64_t h = g * g_ + r;
        const int64_t ro = p_.rope_dim > 0 ? geo_.query_offset(p_.query_rope, s, i, h) : int64_t{0};
        load_joined({p_.query.data, geo_.query_offset(p_.query, s, i, h), p_.query.sd, p_.head_dim},
                    {p_.query_rope.data, ro, p_.query_rope.sd, p_.rope_dim}, sc.q.data() + r * dw_,
                    dw_);
        load_joined(
            {gr_.dout.data, geo_.query_offset(gr_.dout, s, i, h), gr_.dout.sd, p_.value_dim}, {},
            sc.dout.data() + r * dwv_, dwv_);
      }
    }
    if (direct_ && !heads) {
      sparse::transpose_group(k_, q, g_, ldq, dw_, sc.qt.data());
      sparse::transpose_group(k_, o, g_, ldo, dwv_, sc.ot.data());
    }
    if (!pairs_ || !heads) return;
    // qh[l][e] = (q[2l][e], q[2l + 1][e]), oh likewise; a row past G reads as zeros.
    const uint16_t* q16 = reinterpret_cast<const uint16_t*>(q);
    const uint16_t* o16 = reinterpret_cast<const uint16_t*>(o);
    for (int64_t l = 0; 2 * l < g_; ++l) {
      const bool second = 2 * l + 1 < g_;
      k_.rows.interleave_bf16(q16 + 2 * l * 2 * ldq, second ? q16 + (2 * l + 1) * 2 * ldq : nullptr,
                              dqk_, sc.qh.data() + l * dq16_);
      k_.rows.interleave_bf16(o16 + 2 * l * 2 * ldo, second ? o16 + (2 * l + 1) * 2 * ldo : nullptr,
                              p_.value_dim, sc.oh.data() + l * dv16_);
    }
  }

  // Key row c of a chunk (key | rope) and its value row, zero-padded.
  void load_key(Scratch& sc, int64_t c, const sparse::KeyRef& ref) const {
    const sparse::KeySource& src = keys_.source(ref.source);
    load_joined({src.key.data, ref.key, src.key.sd, p_.head_dim},
                {src.rope.data, ref.rope, src.rope.sd, p_.rope_dim}, sc.krow.data() + c * dw_, dw_);
    load_joined({src.value.data, ref.value, src.value.sd, p_.value_dim}, {},
                sc.vrow.data() + c * dwv_, dwv_);
  }

  // n elements of a tensor from element `offset`, `stride` apart.
  struct Part {
    const void* data = nullptr;
    int64_t offset = 0;
    int64_t stride = 1;
    int64_t n = 0;
  };

  // Parts a and b one after the other in a row of `width` words, zero-padded: bf16 pairs on
  // pairs (the elements as they are), float32 otherwise (widened).
  void load_joined(const Part& a, const Part& b, uint32_t* dst, int64_t width) const {
    if (pairs_) {
      std::fill(dst, dst + width, 0u);
      uint16_t* d16 = reinterpret_cast<uint16_t*>(dst);
      sparse::copy_bf16(a.data, a.offset, a.stride, a.n, d16);
      if (b.n > 0) sparse::copy_bf16(b.data, b.offset, b.stride, b.n, d16 + a.n);
      return;
    }
    float* d = reinterpret_cast<float*>(dst);
    sparse::load(k_, a.data, p_.dtype, a.offset, a.stride, a.n, d);
    if (b.n > 0) sparse::load(k_, b.data, p_.dtype, b.offset, b.stride, b.n, d + a.n);
    std::fill(d + a.n + b.n, d + width, 0.0f);
  }

  // Up to a tile of keys from `from` of a row's selection (none past its end).
  struct Chunk {
    const sparse::KeyRef* keys;
    int64_t n;
  };
  static Chunk next_chunk(const std::vector<sparse::KeyRef>& keys, size_t from) {
    const int64_t left = from < keys.size() ? static_cast<int64_t>(keys.size() - from) : 0;
    return {keys.data() + std::min(from, keys.size()), std::min(kKeyTile, left)};
  }

  // For n keys of one chunk (their rows read where they lie, or copied and packed with the next
  // chunk asked for meanwhile; on bf16 pairs, the keys as key pairs too in sc.kp): P = exp(scale
  // q.k - lse) in sc.s and dS = P (dout.v - delta) in sc.dp (columns past n are 0); with a softcap,
  // P of the capped scores and dS times the cap's derivative. `ahead`: parts `part` and `part` + 1
  // of it asked for during the products on rows in place.
  void probabilities(Scratch& sc, const sparse::KeyRef* keys, int64_t n, const Chunk& next,
                     const float* lse, const float* delta, const Shares& ahead,
                     int64_t part) const {
    if (direct_) {
      products_in_place(sc, keys, n, ahead, part);
    } else {
      packed_products(sc, keys, n, next);
    }
    float* sv = sc.s.data();
    float* dp = sc.dp.data();
    const bool capped = p_.softcap > 0.0f;
    for (int64_t r = 0; r < g_; ++r) {
      // The softcap, and its derivative 1 - tanh^2 for dS.
      if (capped) {
        k_.rows.score_mods(sv + r * kKeyTile, p_.softcap, 0.0f, 0, 0, sc.cap.data() + r * kKeyTile);
      }
      std::fill(sv + r * kKeyTile + n, sv + (r + 1) * kKeyTile, -kInf);
    }
    k_.exp_rows(sv, g_, kKeyTile, lse);
    for (int64_t r = 0; r < g_; ++r) {
      for (int64_t c = 0; c < kKeyTile; ++c) {
        dp[r * kKeyTile + c] = sv[r * kKeyTile + c] * (dp[r * kKeyTile + c] - delta[r]);
      }
      if (capped) k_.rows.multiply_into(dp + r * kKeyTile, sc.cap.data() + r * kKeyTile);
    }
  }

  // dq += dS K (dS as bf16 key pairs in sc.ds16) for n keys of a chunk, from their key and rope
  // rows where they lie (value_rows: 8 heads at a time, each pair of key rows interleaved in
  // registers), without the scale (query_pass applies it once, when it stores dq).
  void dq_from_rows(Scratch& sc, const sparse::KeyRef* keys, int64_t n, float* dq,
                    const Shares& ahead, int64_t part) const {
    const uint16_t* rows[2][kKeyTile];  // key, rope
    const int64_t count = round_up(n, 2);
    for (int64_t c = 0; c < count; ++c) {
      const sparse::KeySource* src = c < n ? sources_[keys[c].source] : nullptr;
      rows[0][c] =
          src != nullptr ? static_cast<const uint16_t*>(src->key.data) + keys[c].key : nullptr;
      rows[1][c] = src != nullptr && p_.rope_dim > 0
                       ? static_cast<const uint16_t*>(src->rope.data) + keys[c].rope
                       : nullptr;
    }
    const auto* ds = reinterpret_cast<const uint32_t*>(sc.ds16.data());
    for (int kind = 0; kind < (p_.rope_dim > 0 ? 2 : 1); ++kind) {
      const int64_t width = kind == 0 ? p_.head_dim : p_.rope_dim;
      float* o = dq + (kind == 0 ? 0 : p_.head_dim);
      for (int64_t r0 = 0; r0 < g_; r0 += 8) {
        k_.value_rows({ds + r0 * (kKeyTile / 2), kKeyTile / 2, rows[kind], count, width,
                       o + r0 * dq16_, dq16_, sc.ones.data(), std::min<int64_t>(8, g_ - r0),
                       kind == 0 ? ahead.part(part + r0 / 8) : kernels::RowsAhead{}});
      }
    }
  }

  // The scores (scale q.k) into sc.s and dP (dout.v) into sc.dp, [G][64], for n keys of a
  // chunk read where they lie (gathered_product), and unless dq_rows_ their key pairs in sc.kp
  // (interleaved from the rows as they lie).
  // `ahead`: parts `part` and `part` + 1 of it asked for during the two products.
  void products_in_place(Scratch& sc, const sparse::KeyRef* keys, int64_t n, const Shares& ahead,
                         int64_t part) const {
    const void* rows[3][kKeyTile];  // key, rope, value
    for (int64_t c = 0; c < n; ++c) {
      const sparse::KeySource& src = *sources_[keys[c].source];
      rows[0][c] = static_cast<const uint16_t*>(src.key.data) + keys[c].key;
      rows[1][c] =
          p_.rope_dim > 0 ? static_cast<const uint16_t*>(src.rope.data) + keys[c].rope : nullptr;
      rows[2][c] = static_cast<const uint16_t*>(src.value.data) + keys[c].value;
    }
    const int64_t key_words = p_.head_dim / 2;
    const sparse::GatheredPart scores[2] = {
        {rows[0], key_words, sc.qt.data()},
        {rows[1], p_.rope_dim / 2, sc.qt.data() + key_words * kKeyTile}};
    sparse::gathered_product(k_, scores, p_.rope_dim > 0 ? 2 : 1, n, g_, dw_ * kKeyTile, p_.scale,
                             sc.st.data(), sc.ones.data(), sc.s.data(), ahead.part(part));
    const sparse::GatheredPart values = {rows[2], dwv_, sc.ot.data()};
    sparse::gathered_product(k_, &values, 1, n, g_, dwv_ * kKeyTile, 1.0f, sc.st.data(),
                             sc.ones.data(), sc.dp.data(), ahead.part(part + 1));
    if (dq_rows_) return;
    // kp[l][e] = (k[2l][e], k[2l + 1][e]) over key | rope, zeros past the chunk's keys.
    for (int64_t l = 0; l < kKeyTile / 2; ++l) {
      uint32_t* dst = sc.kp.data() + l * dq16_;
      if (2 * l >= n) {
        std::fill(dst, dst + dqk_, 0u);
        continue;
      }
      for (int part = 0; part < 2; ++part) {
        const int64_t width = part == 0 ? p_.head_dim : p_.rope_dim;
        if (width == 0) continue;
        const auto* a = static_cast<const uint16_t*>(rows[part][2 * l]);
        const auto* b =
            2 * l + 1 < n ? static_cast<const uint16_t*>(rows[part][2 * l + 1]) : nullptr;
        k_.rows.interleave_bf16(a, b, width, dst + (part == 0 ? 0 : p_.head_dim));
      }
    }
  }

  // What probabilities needs from copied and packed rows: the chunk's rows and transposes (on
  // bf16 pairs, the keys as key pairs too), then the two products.
  void packed_products(Scratch& sc, const sparse::KeyRef* keys, int64_t n,
                       const Chunk& next) const {
    const char* krows[kKeyTile];
    const char* vrows[kKeyTile];
    sparse::ChunkAhead ahead(keys_, next.keys, next.n, dtype_size(p_.dtype), p_.head_dim,
                             p_.rope_dim, p_.value_dim, n);
    for (int64_t c = 0; c < n; ++c) {
      ahead.next();
      load_key(sc, c, keys[c]);
      krows[c] = reinterpret_cast<const char*>(sc.krow.data() + c * dw_);
      vrows[c] = reinterpret_cast<const char*>(sc.vrow.data() + c * dwv_);
    }
    std::fill(sc.krow.data() + n * dw_, sc.krow.data() + kKeyTile * dw_, 0u);
    k_.pack_keys(krows, n, dw_, sc.kt.data());
    k_.pack_keys(vrows, n, pairs_ ? dwv_ : p_.value_dim, sc.vt.data());
    if (pairs_) {
      // kp[l][e] = (k[2l][e], k[2l + 1][e]): the B operand of dq += dS K over key pairs.
      const uint16_t* k16 = reinterpret_cast<const uint16_t*>(sc.krow.data());
      for (int64_t l = 0; l < kKeyTile / 2; ++l) {
        k_.rows.interleave_bf16(k16 + 2 * l * 2 * dw_, k16 + (2 * l + 1) * 2 * dw_, dqk_,
                                sc.kp.data() + l * dq16_);
      }
    }
    if (!pairs_) {
      std::fill(sc.vt.data() + p_.value_dim * kKeyTile, sc.vt.data() + dv16_ * kKeyTile, 0u);
    }
    k_.gemm({sc.q.data(), dw_, sc.kt.data(), kKeyTile, sc.s.data(), kKeyTile, g_, kKeyTile, dw_,
             nullptr, p_.scale});
    k_.gemm({sc.dout.data(), dwv_, sc.vt.data(), kKeyTile, sc.dp.data(), kKeyTile, g_, kKeyTile,
             dwv_, nullptr, 1.0f});
  }

  const SparseAttentionParams& p_;
  const SparseAttentionGrads& gr_;
  sparse::QueryGeometry geo_;
  const sparse::KeySelector& keys_;
  const kernels::KernelSet& k_;  // float32 kernels, or bf16 pairs for bf16 inputs
  bool pairs_;
  int64_t g_;
  int64_t dqk_;
  int64_t dq16_;  // dqk_ padded to 16: a product's output width
  int64_t dv16_;
  int64_t rows_;        // G padded to the set's row_align (and to even on pairs)
  int64_t dw_, dwv_;    // words per query/key and value row: dq16_/dv16_, or pairs padded
  int64_t head_pairs_;  // rows of qh and oh: G / 2 rounded up to whole transposed tiles
  // Words of one kept P (or dS) row: the group's head pairs, each block of kPairHeads heads
  // padded to its product's depth (pairs), or G floats.
  int64_t kept_words_;
  // The products read the selected rows where they lie (sparse::rows_in_place; products_in_place)
  bool direct_;
  // With direct_, the query and output-gradient rows are read where they lie too (no rope, rows
  // of whole pair words: sparse::words_in_place).
  bool queries_in_place_;
  // With direct_, dq's product reads the key rows where they lie (dq_from_rows): widths of whole
  // 32-column blocks on a set with value_rows.
  bool dq_rows_;
  std::vector<const sparse::KeySource*> sources_;  // keys_'s, looked up once
  // Token i of sequence b is at position positions_[b] + i; entries_[(position) x N2 + g] kept
  // entries come before those of (that token, key head g).
  std::vector<int64_t> positions_;
  std::vector<int64_t> entries_;
  std::vector<float> sink_share_;  // [rows][N1]
};

}  // namespace

namespace sparse {

std::vector<RowSpan> written_rows(const std::vector<Sequence>& seqs, Layout layout, int64_t seq,
                                  bool keys) {
  std::vector<RowSpan> out;
  for (const Sequence& s : seqs) {
    const int64_t begin = layout == Layout::kTND ? (keys ? s.k_begin : s.q_begin) : s.batch * seq;
    out.push_back({begin, keys ? s.k_len : s.q_len});
  }
  return out;
}

void zero_unwritten_rows(void* dst, DType dtype, int64_t rows, int64_t width,
                         std::vector<RowSpan> written) {
  if (dst == nullptr || width == 0) return;
  std::sort(written.begin(), written.end(),
            [](const RowSpan& a, const RowSpan& b) { return a.begin < b.begin; });
  const int64_t row_bytes = width * static_cast<int64_t>(dtype_size(dtype));
  char* at = static_cast<char*>(dst);
  int64_t next = 0;  // rows before it are written or zeroed
  auto zero_to = [&](int64_t end) {
    if (end > next) std::memset(at + next * row_bytes, 0, (end - next) * row_bytes);
    next = std::max(next, end);
  };
  for (const RowSpan& r : written) {
    zero_to(r.begin);
    next = std::max(next, r.begin + r.count);
  }
  zero_to(rows);
}

void sparse_backward(const SparseAttentionParams& p, const SparseAttentionGrads& gr,
                     const KeySelector& keys, const std::vector<Sequence>& seqs,
                     const Executor& executor, Isa isa) {
  require_supported(isa);
  Backward run(p, gr, keys, isa);
  const int threads = std::max(1, executor.num_workers());
  ScratchPool<Backward::Scratch, Backward> scratch(run, threads);
  run.number_tokens(seqs);
  each_token_and_head(executor, core::token_tasks(seqs, kTokensPerTask), seqs, scratch,
                      run.kernel_set(), p.heads_k,
                      [&](Backward::Scratch& sc, const Sequence& seq, int64_t i, int64_t g) {
                        run.count_entries(sc, seq, i, g);
                      });
  run.sum_entries();
  const std::vector<int64_t> spans = run.spans();
  const int64_t num_spans = static_cast<int64_t>(spans.size()) - 1;
  // Key blocks of every source: about four per thread per (sequence, key head), at least 64 keys
  // each, with the tokens [first, last] that may select them, cut into one piece per span those
  // tokens reach. A block sums its pieces in span order into one buffer (made by its first piece,
  // stored and freed by its last), so a key's gradient sums its tokens in order: the same bits
  // however the blocks and spans fall.
  struct Block {
    int k;
    KeyTask keys;
  };
  struct Piece {
    size_t block;
    int64_t i0, i1;  // the block's tokens in the span
    bool first, last;
  };
  std::vector<Block> blocks;
  std::vector<size_t> unselected;  // blocks no token selects: zeros stored
  std::vector<std::vector<Piece>> pieces(std::max<int64_t>(num_spans, 0));
  const auto span_of = [&](int64_t position) {
    return std::upper_bound(spans.begin(), spans.end(), position) - spans.begin() - 1;
  };
  for (int k = 0; k < keys.num_sources(); ++k) {
    for (const KeyTask& t : core::key_tasks(keys.key_sequences(k), p.heads_k, 4 * threads, 64)) {
      const Sequence& s = seqs[t.b];
      int64_t first = 0, last = -1;
      for (int64_t i = 0; i < s.q_len; ++i) {
        if (!keys.may_select(s, i, k, t.j0, t.j1)) continue;
        if (last < 0) first = i;
        last = i;
      }
      const size_t block = blocks.size();
      blocks.push_back({k, t});
      if (last < 0) {
        unselected.push_back(block);
        continue;
      }
      const int64_t base = run.position(s, 0);
      const int64_t u0 = span_of(base + first), u1 = span_of(base + last);
      for (int64_t u = u0; u <= u1; ++u) {
        pieces[u].push_back({block, std::max(first, spans[u] - base),
                             std::min(last + 1, spans[u + 1] - base), u == u0, u == u1});
      }
    }
  }
  const int64_t row_floats = run.key_row_floats();
  auto store = [&](const Block& bl, float* grads) {
    const KeyTask& t = bl.keys;
    run.store_keys(bl.k, keys.key_sequences(bl.k)[t.b], t.g, t.j0, t.j1, grads);
  };
  // Stage u: the query pass of span u beside the key pass of span u - 1.
  std::vector<AlignedBuffer<float>> sums(blocks.size());
  SpanStore stores[2];
  for (int64_t u = 0; u <= num_spans; ++u) {
    std::vector<TokenTask> tokens;
    SpanStore& next = stores[u % 2];
    if (u < num_spans) {
      run.open_span(next, spans[u], spans[u + 1]);
      for (const Sequence& s : seqs) {
        const int64_t base = run.position(s, 0);
        const int64_t i1 = std::min(s.q_len, spans[u + 1] - base);
        for (int64_t i = std::max<int64_t>(0, spans[u] - base); i < i1; i += kTokensPerTask) {
          tokens.push_back({static_cast<int32_t>(s.batch), i, std::min(i1, i + kTokensPerTask)});
        }
      }
    }
    const std::vector<Piece> none;
    const std::vector<Piece>& done = u > 0 ? pieces[u - 1] : none;
    const SpanStore& kept = stores[(u + 1) % 2];
    const int64_t key_work = static_cast<int64_t>(done.size());
    run_dynamic(
        executor, key_work + static_cast<int64_t>(tokens.size()), [&](int64_t w, int thread) {
          const kernels::WorkerScope scope(run.kernel_set());
          Backward::Scratch& sc = scratch[thread];
          if (w >= key_work) {
            const TokenTask& task = tokens[w - key_work];
            for (int64_t i = task.i0; i < task.i1; ++i) {
              for (int64_t g = 0; g < p.heads_k; ++g) {
                run.query_pass(sc, seqs[task.b], i, g, next, i + 1 < task.i1 || g + 1 < p.heads_k);
              }
            }
            return;
          }
          const Piece& pc = done[w];
          const Block& bl = blocks[pc.block];
          const KeyTask& t = bl.keys;
          AlignedBuffer<float>& sum = sums[pc.block];
          if (pc.first) sum = AlignedBuffer<float>((t.j1 - t.j0) * row_floats);
          run.key_pass(sc, bl.k, seqs[t.b], t.g, t.j0, t.j1, pc.i0, pc.i1, sum.data(), kept);
          if (!pc.last) return;
          store(bl, sum.data());
          sum = AlignedBuffer<float>();
        });
  }
  run_dynamic(executor, static_cast<int64_t>(unselected.size()), [&](int64_t w, int) {
    const kernels::WorkerScope scope(run.kernel_set());
    const Block& bl = blocks[unselected[w]];
    AlignedBuffer<float> zeros((bl.keys.j1 - bl.keys.j0) * row_floats);
    store(bl, zeros.data());
  });
  run.finish_sinks(seqs);
}

}  // namespace sparse

void sparse_flash_attention_backward(const SparseAttentionParams& p, const SparseAttentionGrads& gr,
                                     const Executor& executor, Isa isa) {
  if (p.layout_kv == Layout::kPagedBBND) {
    throw ArgumentError("layout_kv", "PA_BSND (paged keys and values) has no backward");
  }
  if (p.kv_format != CacheFormat::kPlain) {
    throw ArgumentError("key_scale", "a quantized key and value have no backward");
  }
  validate(p);
  require_supported(isa);
  const int64_t q_rows = p.layout_query == Layout::kTND ? p.seq_q : p.batch * p.seq_q;
  const int64_t k_rows = p.layout_kv == Layout::kTND ? p.seq_k : p.batch * p.seq_k;
  const std::vector<Sequence> seqs = sparse_attention_sequences(p);
  // Rows no pass reaches (past a length) are zero; the passes write every other one.
  const auto q_written = sparse::written_rows(seqs, p.layout_query, p.seq_q, false);
  const auto k_written = sparse::written_rows(seqs, p.layout_kv, p.seq_k, true);
  sparse::zero_unwritten_rows(gr.dq, p.dtype, q_rows, p.heads_q * p.head_dim, q_written);
  sparse::zero_unwritten_rows(gr.dk, p.dtype, k_rows, p.heads_k * p.head_dim, k_written);
  sparse::zero_unwritten_rows(gr.dv, p.dtype, k_rows, p.heads_k * p.value_dim, k_written);
  if (p.rope_dim > 0) {
    sparse::zero_unwritten_rows(gr.dq_rope, p.dtype, q_rows, p.heads_q * p.rope_dim, q_written);
    sparse::zero_unwritten_rows(gr.dk_rope, p.dtype, k_rows, p.heads_k * p.rope_dim, k_written);
  }
  const sparse::IndexedKeys keys(p, seqs, &gr);
  sparse::sparse_backward(p, gr, keys, seqs, executor, isa);
}

}  // namespace opmesh::core
