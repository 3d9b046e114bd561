#include "sparse_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "../aligned_buffer.h"
#include "../errors.h"
#include "../kernels/kernel_set.h"
#include "../work_split.h"
#include "config.h"
#include "flash_attn.h"
#include "sparse_attention_detail.h"

namespace opmesh::core {
namespace {

using kernels::kKeyTile;
using kernels::round_up;

std::string str(int64_t v) { return std::to_string(v); }

constexpr float kInf = std::numeric_limits<float>::infinity();

// Tokens per task: enough work to amortise a task, few enough to balance.
constexpr int64_t kTokensPerTask = 8;

// log(exp(a) + exp(b)), exact where either is -inf.
float log_add(float a, float b) {
  const float hi = std::max(a, b);
  if (hi == -kInf) return -kInf;
  if (hi == kInf) return kInf;
  return hi + std::log1p(std::exp(std::min(a, b) - hi));
}

}  // namespace

std::vector<Sequence> sparse_attention_sequences(const SparseAttentionParams& p) {
  return query_key_sequences(p, p.layout_kv);
}

void validate(const SparseAttentionParams& p) {
  validate(p, p.layout_kv, "layout_kv", "actual_seq_lengths_query", "actual_seq_lengths_kv");
  if (p.sparse_block_size < 1 || p.sparse_block_size > attention::kMaxTokens) {
    throw ArgumentError("sparse_block_size", "must be >= 1, got " + str(p.sparse_block_size));
  }
  if (p.sparse_count < 0) throw ArgumentError("sparse_indices", "negative K");
  if (p.kv_format != CacheFormat::kPlain) {
    if (p.kv_format != CacheFormat::kInt8 && p.kv_format != CacheFormat::kFp8E4M3) {
      throw ArgumentError("kv_format", "is not a cache format");
    }
    // An empty key's scales may have no storage: no row of it is ever read.
    const bool rows =
        p.batch > 0 && (p.layout_kv == Layout::kPagedBBND ? p.block_count > 0 : p.seq_k > 0);
    if (p.key_scale.data == nullptr && rows) throw ArgumentError("key_scale", "is null");
    if (p.value_scale.data == nullptr && rows) throw ArgumentError("value_scale", "is null");
    if (p.key.sd != 1) throw ArgumentError("key", "a quantized key needs unit stride along D");
    if (p.value.sd != 1) throw ArgumentError("value", "a quantized value needs unit stride");
  }
  attention::check_softcap(p.softcap);
  check_grouped_heads(p.heads_q, p.heads_k);
  if (p.index_heads != 1 && p.index_heads != p.heads_k) {
    throw ArgumentError("sparse_indices", "key-head dim must be 1 or N2=" + str(p.heads_k) +
                                              ", got " + str(p.index_heads));
  }
  if (p.head_dim < 1 || p.head_dim + p.rope_dim > attention::kMaxHeadDim) {
    throw ArgumentError("query",
                        "head dim D + Dr must be in [1, " + str(attention::kMaxHeadDim) + "]");
  }
  if (p.value_dim < 1 || p.value_dim > attention::kMaxHeadDim) {
    throw ArgumentError("value", "head dim must be in [1, " + str(attention::kMaxHeadDim) + "]");
  }
  Selection selection;
  selection.indices = p.indices;
  selection.heads = p.index_heads;
  selection.count = p.sparse_count;
  selection.block_size = p.sparse_block_size;
  selection.tnd = p.layout_query == Layout::kTND;
  validate(selection, sparse_attention_sequences(p));
}

namespace {

class Forward {
 public:
  Forward(const SparseAttentionParams& p, const sparse::KeySelector& keys, Isa isa)
      : p_(p),
        geo_(p),
        keys_(keys),
        k_(kernels::select_set(isa, p.dtype, -1, true)),
        pairs_(k_.word == kernels::Word::kBf16Pair),
        raw_scores_(pairs_ && p.scale > 0.0f && p.softcap == 0.0f),
        g_(geo_.groups()),
        dqk_(p.head_dim + p.rope_dim),
        words_(pairs_ ? (dqk_ + 1) / 2 : dqk_),
        dw_(round_up(words_, k_.depth_align)),
        dvp_(round_up(p.value_dim, 16)),
        rows_(round_up(g_, k_.row_align)),
        gp_(round_up(g_, 16)),
        direct_(pairs_ && k_.value_rows != nullptr && sparse::rows_in_place(p, keys, k_, 32)),
        queries_in_place_(direct_ && p.rope_dim == 0 && 2 * dw_ == p.head_dim &&
                          sparse::words_in_place(p.query, p.head_dim)) {
    for (int i = 0; i < keys.num_sources(); ++i) sources_.push_back(&keys.source(i));
  }

  struct Scratch {
    explicit Scratch(const Forward& f)
        : q(f.rows_ * f.dw_),
          kp(f.dw_ * kKeyTile),
          vp(kKeyTile * f.dvp_),
          s(f.rows_ * kKeyTile),
          pb(f.rows_ * kKeyTile),
          o(f.rows_ * f.dvp_),
          stage(kKeyTile * std::max(f.dqk_, f.dw_)),
          value_rows(2 * f.p_.value_dim),
          qt(f.direct_ ? (f.gp_ + kKeyTile - 1) / kKeyTile * f.dw_ * kKeyTile : 0),
          st(f.direct_ ? kKeyTile * f.gp_ : 0),
          ones(kKeyTile, 1.0f),
          query_rows(f.g_),
          m(f.rows_),
          l(f.rows_),
          corr(f.rows_) {}
    // With bf16 pairs the words below hold pairs: query rows of dw pair words, keys packed as
    // [dw][64] pair words, values as [32][dvp] pairs of consecutive keys, probabilities in pb.
    AlignedBuffer<float> q;            // [rows][dw] query rows of the group (query | rope)
    AlignedBuffer<uint32_t> kp;        // [dw][64] selected keys, transposed
    AlignedBuffer<float> vp;           // [64][dvp] selected values
    AlignedBuffer<float> s;            // [rows][64] scores, then probabilities
    AlignedBuffer<uint16_t> pb;        // [rows][64] probabilities in bf16 (pairs only)
    AlignedBuffer<float> o;            // [rows][dvp] output accumulator
    AlignedBuffer<float> stage;        // [64][dqk] key rows (key | rope) before the transpose
    std::vector<uint16_t> value_rows;  // a quantized pair of value rows, dequantized (pairs)
    // Rows read in place: the query rows transposed, [dw][64] pair words per 64 heads, and the
    // scores as the product leaves them, S^T [64 keys][gp].
    AlignedBuffer<uint32_t> qt;
    AlignedBuffer<float> st;
    std::vector<float> ones;
    // Queries read in place: the next group's rows, asked for from memory during this one's
    // value products.
    std::vector<const char*> query_rows;
    std::vector<float> m, l, corr;
    std::vector<sparse::KeyRef> keys;
  };

  const kernels::KernelSet& kernel_set() const { return k_; }

  // Row (s, i) of key head g over its selected keys [k0, k1) (k1 < 0: to the last): the output
  // and statistics, or with `slot` the unnormalised partial result (m, l, o) there.
  void row(Scratch& sc, const Sequence& s, int64_t i, int64_t g, int64_t k0 = 0, int64_t k1 = -1,
           float* slot = nullptr) const {
    keys_.select(s, i, g, nullptr, sc.keys);
    const int64_t size = static_cast<int64_t>(sc.keys.size());
    const int64_t end = k1 < 0 ? size : std::min(k1, size);
    std::fill(sc.m.begin(), sc.m.end(), -kInf);
    std::fill(sc.l.begin(), sc.l.end(), 0.0f);
    std::fill(sc.o.data(), sc.o.data() + rows_ * dvp_, 0.0f);
    if (k0 < end) pack_queries(sc, s, i, g);
    const int64_t chunks = k0 < end ? (end - k0 + kKeyTile - 1) / kKeyTile : 0;
    const int64_t queries_ahead = next_queries(sc, s, i, g);
    for (int64_t c0 = k0; c0 < end; c0 += kKeyTile) {
      const int64_t n = std::min<int64_t>(kKeyTile, end - c0);
      const int64_t next = std::min<int64_t>(kKeyTile, std::max<int64_t>(end - c0 - n, 0));
      // This chunk's share of the next group's query rows.
      const int64_t chunk = (c0 - k0) / kKeyTile;
      const kernels::RowsAhead queries =
          kernels::share({sc.query_rows.data(), queries_ahead, 2 * p_.head_dim}, chunk, chunks);
      float* sv = sc.s.data();
      // bf16 sets take the scores unscaled and fold a positive scale into the softmax's exp.
      if (direct_) {
        scores_in_place(sc, sc.keys.data() + c0, n);
      } else {
        sparse::ChunkAhead ahead(keys_, sc.keys.data() + c0 + n, next, dtype_size(p_.dtype),
                                 p_.head_dim, p_.rope_dim, p_.value_dim, n);
        pack(sc, sc.keys.data() + c0, n, ahead);
        k_.gemm({sc.q.data(), dw_, sc.kp.data(), kKeyTile, sv, kKeyTile, g_, kKeyTile, dw_, nullptr,
                 raw_scores_ ? 1.0f : p_.scale});
      }
      for (int64_t r = 0; r < g_; ++r) {
        if (p_.softcap > 0.0f)
          k_.rows.score_mods(sv + r * kKeyTile, p_.softcap, 0.0f, 0, 0, nullptr);
        std::fill(sv + r * kKeyTile + n, sv + (r + 1) * kKeyTile, -kInf);
      }
      if (pairs_) {
        k_.softmax_bf16(sv, g_, kKeyTile, raw_scores_ ? p_.scale : 1.0f, sc.m.data(), sc.l.data(),
                        sc.corr.data(), sc.pb.data());
        if (direct_) {
          values_in_place(sc, sc.keys.data() + c0, n, sc.keys.data() + c0 + n, next, queries);
        } else {
          k_.gemm({sc.pb.data(), kKeyTile / 2, sc.vp.data(), dvp_, sc.o.data(), dvp_, g_, dvp_,
                   kKeyTile / 2, sc.corr.data(), 1.0f});
        }
      } else {
        k_.softmax(sv, g_, kKeyTile, sc.m.data(), sc.l.data(), sc.corr.data());
        k_.gemm({sv, kKeyTile, sc.vp.data(), dvp_, sc.o.data(), dvp_, g_, dvp_, kKeyTile,
                 sc.corr.data(), 1.0f});
      }
    }
    if (slot == nullptr) return write(s, i, g, sc.m.data(), sc.l.data(), sc.o.data());
    // [m | l | o] of each row of the group.
    for (int64_t r = 0; r < g_; ++r) {
      float* dst = slot + r * slot_row();
      dst[0] = sc.m[r];
      dst[1] = sc.l[r];
      std::copy(sc.o.data() + r * dvp_, sc.o.data() + r * dvp_ + p_.value_dim, dst + 2);
    }
  }

  // Floats of one partial result: per row of the group, its max, sum and unnormalised output.
  int64_t slot_row() const { return 2 + p_.value_dim; }
  int64_t slot_floats() const { return g_ * slot_row(); }

  // Merges the partial results in `count` consecutive slots (in slot order) and writes the row.
  void combine(Scratch& sc, const Sequence& s, int64_t i, int64_t g, const float* slots,
               int64_t count) const {
    for (int64_t r = 0; r < g_; ++r) {
      float m = -kInf;
      for (int64_t k = 0; k < count; ++k)
        m = std::max(m, slots[k * slot_floats() + r * slot_row()]);
      float l = 0.0f;
      float* o = sc.o.data() + r * dvp_;
      std::fill(o, o + p_.value_dim, 0.0f);
      for (int64_t k = 0; k < count && m > -kInf; ++k) {
        const float* part = slots + k * slot_floats() + r * slot_row();
        if (part[0] == -kInf) continue;
        const float w = std::exp(part[0] - m);
        l += part[1] * w;
        for (int64_t e = 0; e < p_.value_dim; ++e) o[e] += part[2 + e] * w;
      }
      sc.m[r] = m;
      sc.l[r] = l;
    }
    write(s, i, g, sc.m.data(), sc.l.data(), sc.o.data());
  }

 private:
  // The scores of n selected keys into sc.s ([g][64], as the packed product leaves them) from
  // the key (and rope) rows where they lie (gathered_product).
  void scores_in_place(Scratch& sc, const sparse::KeyRef* keys, int64_t n) const {
    const void* key_rows[kKeyTile];
    const void* rope_rows[kKeyTile];
    for (int64_t c = 0; c < n; ++c) {
      const sparse::KeySource& src = *sources_[keys[c].source];
      key_rows[c] = static_cast<const uint16_t*>(src.key.data) + keys[c].key;
      if (p_.rope_dim > 0)
        rope_rows[c] = static_cast<const uint16_t*>(src.rope.data) + keys[c].rope;
    }
    const int64_t key_words = p_.head_dim / 2;
    const sparse::GatheredPart parts[2] = {
        {key_rows, key_words, sc.qt.data()},
        {rope_rows, p_.rope_dim / 2, sc.qt.data() + key_words * kKeyTile}};
    sparse::gathered_product(k_, parts, p_.rope_dim > 0 ? 2 : 1, n, g_, dw_ * kKeyTile,
                             raw_scores_ ? 1.0f : p_.scale, sc.st.data(), sc.ones.data(),
                             sc.s.data());
  }

  // o = corr o + P V for n selected keys from the value rows where they lie (the probabilities
  // in sc.pb), 8 rows of the group a call: the pair GEMM's bits. `queries`: rows asked for from
  // memory too (the next group's query rows, this chunk's share).
  void values_in_place(Scratch& sc, const sparse::KeyRef* keys, int64_t n,
                       const sparse::KeyRef* next, int64_t next_n,
                       const kernels::RowsAhead& queries) const {
    // The next chunk's key and value rows, asked for from memory during the first product (a
    // burst of them all at once loses to none at all).
    const char* ahead[3 * kKeyTile];
    int64_t ahead_n = 0;
    for (int64_t c = 0; c < next_n; ++c) {
      const sparse::KeySource& src = *sources_[next[c].source];
      const char* key = static_cast<const char*>(src.key.data) + 2 * next[c].key;
      const char* value = static_cast<const char*>(src.value.data) + 2 * next[c].value;
      ahead[ahead_n++] = key;
      if (value != key) ahead[ahead_n++] = value;
      if (p_.rope_dim > 0) {
        ahead[ahead_n++] = static_cast<const char*>(src.rope.data) + 2 * next[c].rope;
      }
    }
    const int64_t ahead_bytes = 2 * std::max(p_.head_dim, p_.value_dim);
    const uint16_t* rows[kKeyTile];
    const int64_t count = round_up(n, 2);
    for (int64_t c = 0; c < count; ++c) {
      rows[c] = nullptr;
      if (c < n) {
        rows[c] =
            static_cast<const uint16_t*>(sources_[keys[c].source]->value.data) + keys[c].value;
      }
    }
    const uint32_t* pb = reinterpret_cast<const uint32_t*>(sc.pb.data());
    // The calls that ask for no key rows ask for an even part each of `queries`.
    const int64_t calls = (g_ + 7) / 8 - (ahead_n > 0 ? 1 : 0);
    for (int64_t r0 = 0, call = 0; r0 < g_; r0 += 8) {
      kernels::RowsAhead rows_ahead{ahead, ahead_n, ahead_bytes};
      if (r0 > 0 || ahead_n == 0) {
        rows_ahead = kernels::share(queries, call, calls);
        ++call;
      }
      k_.value_rows({pb + r0 * (kKeyTile / 2), kKeyTile / 2, rows, count, p_.value_dim,
                     sc.o.data() + r0 * dvp_, dvp_, sc.corr.data() + r0,
                     std::min<int64_t>(8, g_ - r0), rows_ahead});
    }
  }

  // The query rows of the group a worker takes next (key head g + 1 of token i, else token
  // i + 1's first) into sc.query_rows, when queries are read in place: their count (0: none).
  int64_t next_queries(Scratch& sc, const Sequence& s, int64_t i, int64_t g) const {
    if (!queries_in_place_) return 0;
    if (++g == p_.heads_k) {
      g = 0;
      if (++i >= s.q_len) return 0;
    }
    const char* base = static_cast<const char*>(p_.query.data);
    for (int64_t r = 0; r < g_; ++r) {
      sc.query_rows[r] = base + 2 * geo_.query_offset(p_.query, s, i, g * g_ + r);
    }
    return g_;
  }

  void pack_queries(Scratch& sc, const Sequence& s, int64_t i, int64_t g) const {
    if (queries_in_place_) {  // Q^T from the rows where they lie
      const auto* rows = static_cast<const uint32_t*>(p_.query.data);
      sparse::transpose_group(k_, rows + geo_.query_offset(p_.query, s, i, g * g_) / 2, g_,
                              p_.query.sn / 2, dw_, sc.qt.data());
      return;
    }
    if (pairs_) pack_query_pairs(sc, s, i, g);
    if (pairs_ && direct_) {  // Q^T: the B operand of scores_in_place
      sparse::transpose_group(k_, reinterpret_cast<const uint32_t*>(sc.q.data()), g_, dw_, dw_,
                              sc.qt.data());
    }
    if (pairs_) return;
    for (int64_t r = 0; r < g_; ++r) {
      const int64_t h = g * g_ + r;
      float* dst = sc.q.data() + r * dw_;
      sparse::load(k_, p_.query.data, p_.dtype, geo_.query_offset(p_.query, s, i, h), p_.query.sd,
                   p_.head_dim, dst);
      if (p_.rope_dim > 0) {
        sparse::load(k_, p_.query_rope.data, p_.dtype, geo_.query_offset(p_.query_rope, s, i, h),
                     p_.query_rope.sd, p_.rope_dim, dst + p_.head_dim);
      }
      std::fill(dst + dqk_, dst + dw_, 0.0f);
    }
  }

  // The group's query rows as bf16 pairs (query | rope, zero-padded to dw words).
  void pack_query_pairs(Scratch& sc, const Sequence& s, int64_t i, int64_t g) const {
    for (int64_t r = 0; r < g_; ++r) {
      const int64_t h = g * g_ + r;
      uint32_t* words = reinterpret_cast<uint32_t*>(sc.q.data()) + r * dw_;
      std::fill(words, words + dw_, 0u);
      uint16_t* dst = reinterpret_cast<uint16_t*>(words);
      sparse::copy_bf16(p_.query.data, geo_.query_offset(p_.query, s, i, h), p_.query.sd,
                        p_.head_dim, dst);
      if (p_.rope_dim > 0) {
        sparse::copy_bf16(p_.query_rope.data, geo_.query_offset(p_.query_rope, s, i, h),
                          p_.query_rope.sd, p_.rope_dim, dst + p_.head_dim);
      }
    }
  }

  // Keys and values of n selected keys as bf16 pairs: keys packed [dw][64], values with keys
  // 2l and 2l + 1 interleaved element by element.
  void pack_pairs(Scratch& sc, const sparse::KeyRef* keys, int64_t n,
                  sparse::ChunkAhead& ahead) const {
    const char* rows[kKeyTile];
    uint32_t* stage = reinterpret_cast<uint32_t*>(sc.stage.data());
    for (int64_t c = 0; c < n; ++c) {
      ahead.next();
      const sparse::KeySource& src = keys_.source(keys[c].source);
      uint32_t* words = stage + c * dw_;
      std::fill(words, words + dw_, 0u);
      uint16_t* dst = reinterpret_cast<uint16_t*>(words);
      if (src.format != CacheFormat::kPlain) {
        k_.rows.dequantize_bf16(static_cast<const uint8_t*>(src.key.data) + keys[c].key, src.format,
                                keys[c].key_scale, p_.head_dim, dst);
      } else {
        sparse::copy_bf16(src.key.data, keys[c].key, src.key.sd, p_.head_dim, dst);
      }
      if (p_.rope_dim > 0) {
        sparse::copy_bf16(src.rope.data, keys[c].rope, src.rope.sd, p_.rope_dim, dst + p_.head_dim);
      }
      rows[c] = reinterpret_cast<const char*>(words);
    }
    k_.pack_keys(rows, n, dw_, sc.kp.data());
    uint32_t* vp = reinterpret_cast<uint32_t*>(sc.vp.data());
    std::fill(vp, vp + kKeyTile / 2 * dvp_, 0u);
    const int64_t dv = p_.value_dim;
    auto value = [&](int64_t c) -> const uint16_t* {
      const sparse::KeySource& src = keys_.source(keys[c].source);
      if (src.format == CacheFormat::kPlain) {
        return static_cast<const uint16_t*>(src.value.data) + keys[c].value;
      }
      // A quantized row, dequantized into the staging row of its pair position.
      uint16_t* row = sc.value_rows.data() + (c % 2) * dv;
      k_.rows.dequantize_bf16(static_cast<const uint8_t*>(src.value.data) + keys[c].value,
                              src.format, keys[c].value_scale, dv, row);
      return row;
    };
    auto stride = [&](int64_t c) { return keys_.source(keys[c].source).value.sd; };
    for (int64_t c = 0; c < n; c += 2) {
      uint32_t* dst = vp + (c / 2) * dvp_;
      if (stride(c) == 1 && (c + 1 >= n || stride(c + 1) == 1)) {
        k_.rows.interleave_bf16(value(c), c + 1 < n ? value(c + 1) : nullptr, dv, dst);
        continue;
      }
      for (int64_t half = 0; half < 2 && c + half < n; ++half) {
        const uint16_t* src = value(c + half);
        const int64_t sd = stride(c + half);
        for (int64_t e = 0; e < dv; ++e)
          dst[e] |= static_cast<uint32_t>(src[e * sd]) << (16 * half);
      }
    }
  }

  // Keys and values of n selected keys: keys transposed into kp, values as rows of vp.
  void pack(Scratch& sc, const sparse::KeyRef* keys, int64_t n, sparse::ChunkAhead& ahead) const {
    if (pairs_) return pack_pairs(sc, keys, n, ahead);
    const char* rows[kKeyTile];
    for (int64_t c = 0; c < n; ++c) {
      ahead.next();
      const sparse::KeySource& src = keys_.source(keys[c].source);
      float* dst = sc.stage.data() + c * dqk_;
      const bool quantized = src.format != CacheFormat::kPlain;
      if (quantized) {
        k_.rows.dequantize_f32(static_cast<const uint8_t*>(src.key.data) + keys[c].key, src.format,
                               keys[c].key_scale, p_.head_dim, dst);
      } else {
        sparse::load(k_, src.key.data, p_.dtype, keys[c].key, src.key.sd, p_.head_dim, dst);
      }
      if (p_.rope_dim > 0) {
        sparse::load(k_, src.rope.data, p_.dtype, keys[c].rope, src.rope.sd, p_.rope_dim,
                     dst + p_.head_dim);
      }
      rows[c] = reinterpret_cast<const char*>(dst);
      float* v = sc.vp.data() + c * dvp_;
      if (quantized) {
        k_.rows.dequantize_f32(static_cast<const uint8_t*>(src.value.data) + keys[c].value,
                               src.format, keys[c].value_scale, p_.value_dim, v);
      } else {
        sparse::load(k_, src.value.data, p_.dtype, keys[c].value, src.value.sd, p_.value_dim, v);
      }
      std::fill(v + p_.value_dim, v + dvp_, 0.0f);
    }
    std::fill(sc.vp.data() + n * dvp_, sc.vp.data() + kKeyTile * dvp_, 0.0f);
    k_.pack_keys(rows, n, dqk_, sc.kp.data());
    std::fill(sc.kp.data() + dqk_ * kKeyTile, sc.kp.data() + dw_ * kKeyTile, 0u);
  }

  // The group's rows from their running max m, sum l and unnormalised output o ([rows][dvp]).
  void write(const Sequence& s, int64_t i, int64_t g, const float* ms, const float* ls,
             const float* os) const {
    const int64_t stats = geo_.stats_offset(s, i, g);
    for (int64_t r = 0; r < g_; ++r) {
      const int64_t h = g * g_ + r;
      const float m = ms[r];
      float denom = ls[r];
      if (p_.sinks != nullptr && m > -kInf) denom += std::exp(p_.sinks[h] - m);
      const float inv = m > -kInf && denom > 0.0f ? 1.0f / denom : 0.0f;
      store_row(k_, p_.out.data, p_.dtype, geo_.query_offset(p_.out, s, i, h), p_.out.sd,
                p_.value_dim, os + r * dvp_, inv);
      if (p_.softmax_max != nullptr) {
        p_.softmax_max[stats + r] = m;
        p_.softmax_sum[stats + r] = ls[r];
      }
      if (p_.softmax_lse != nullptr) {
        float lse = m > -kInf ? m + std::log(ls[r]) : -kInf;
        if (p_.sinks != nullptr) lse = log_add(lse, p_.sinks[h]);
        p_.softmax_lse[stats + r] = lse;
      }
    }
  }

  const SparseAttentionParams& p_;
  sparse::QueryGeometry geo_;
  const sparse::KeySelector& keys_;
  const kernels::KernelSet& k_;  // float32 kernels, or bf16 pairs for bf16 inputs
  bool pairs_;
  bool raw_scores_;  // bf16 pairs, a positive scale, no softcap: the scale in the exp
  int64_t g_;        // query heads per key head: the rows of one product
  int64_t dqk_;      // D + Dr
  int64_t words_;    // words per query/key row: dqk_, or its pairs
  int64_t dw_;       // words_ padded to the set's depth_align
  int64_t dvp_;      // Dv padded to 16
  int64_t rows_;
  int64_t gp_;  // the group's heads rounded up to whole 16-column vectors
  // The selected rows read where they lie (sparse::rows_in_place): the scores through
  // scores_in_place, P.V through value_rows (values_in_place), whole 32-column value blocks.
  bool direct_;
  bool queries_in_place_;  // with direct_, Q^T made from the query rows where they lie
  std::vector<const sparse::KeySource*> sources_;  // keys_'s, looked up once
};

}  // namespace

namespace sparse {

bool rows_in_place(const SparseAttentionParams& p, const KeySelector& keys,
                   const kernels::KernelSet& k, int64_t value_dim_multiple) {
  if (k.word != kernels::Word::kBf16Pair || k.gemm_rows == nullptr || p.head_dim % 2 != 0 ||
      p.rope_dim % 2 != 0 || p.value_dim % value_dim_multiple != 0) {
    return false;
  }
  for (int i = 0; i < keys.num_sources(); ++i) {
    const KeySource& src = keys.source(i);
    if (src.format != CacheFormat::kPlain || src.key.sd != 1 || src.value.sd != 1 ||
        (p.rope_dim > 0 && src.rope.sd != 1)) {
      return false;
    }
  }
  return true;
}

void gathered_product(const kernels::KernelSet& k, const GatheredPart* parts, int count, int64_t n,
                      int64_t g, int64_t chunk_words, float alpha, float* st, const float* ones,
                      float* out, const kernels::RowsAhead& ahead) {
  const int64_t gp = round_up(g, 16);
  for (int64_t h0 = 0; h0 < g; h0 += kKeyTile) {
    const int64_t cols = std::min<int64_t>(kKeyTile, gp - h0);
    for (int i = 0; i < count; ++i) {
      k.gemm_rows(parts[i].rows, {nullptr, 0, parts[i].bt + h0 / kKeyTile * chunk_words, kKeyTile,
                                  st + h0, gp, n, cols, parts[i].words, i == 0 ? nullptr : ones,
                                  alpha, h0 == 0 && i == 0 ? ahead : kernels::RowsAhead{}});
    }
  }
  const char* lines[kKeyTile];
  for (int64_t c = 0; c < n; ++c) lines[c] = reinterpret_cast<const char*>(st + c * gp);
  k.pack_keys(lines, n, g, reinterpret_cast<uint32_t*>(out));
}

void transpose_group(const kernels::KernelSet& k, const uint32_t* rows, int64_t g, int64_t ld,
                     int64_t words, uint32_t* bt) {
  for (int64_t h0 = 0; h0 < g; h0 += kKeyTile) {
    const char* lines[kKeyTile];
    const int64_t count = std::min<int64_t>(kKeyTile, g - h0);
    for (int64_t r = 0; r < count; ++r) {
      lines[r] = reinterpret_cast<const char*>(rows + (h0 + r) * ld);
    }
    k.pack_keys(lines, count, words, bt + h0 / kKeyTile * words * kKeyTile);
  }
}

void sparse_forward(const SparseAttentionParams& p, const KeySelector& keys,
                    const std::vector<Sequence>& seqs, const Executor& executor, Isa isa,
                    const TokenSchedule* schedule) {
  require_supported(isa);
  const Forward run(p, keys, isa);
  // Rows no task reaches (BSND rows past a length, TND rows past a sequence's used length): zero
  // output, statistics (-inf, 0) below.
  const int64_t rows = p.layout_query == Layout::kTND ? p.seq_q : p.batch * p.seq_q;
  {
    std::vector<RowSpan> written = written_rows(seqs, p.layout_query, p.seq_q, false);
    std::sort(written.begin(), written.end(),
              [](const RowSpan& a, const RowSpan& b) { return a.begin < b.begin; });
    const std::vector<float> zeros(p.value_dim, 0.0f);
    auto zero_rows = [&](int64_t from, int64_t to) {
      for (int64_t r = from; r < to; ++r) {
        const int64_t at = p.layout_query == Layout::kTND
                               ? r * p.out.ss
                               : r / p.seq_q * p.out.sb + r % p.seq_q * p.out.ss;
        for (int64_t h = 0; h < p.heads_q; ++h) {
          store_row(p.out.data, p.dtype, at + h * p.out.sn, p.out.sd, p.value_dim, zeros.data(),
                    1.0f);
        }
      }
    };
    int64_t next = 0;  // rows before it are written by a task or zeroed
    for (const RowSpan& w : written) {
      zero_rows(next, w.begin);
      next = std::max(next, w.begin + w.count);
    }
    zero_rows(next, rows);
  }
  if (p.softmax_max != nullptr) {
    std::fill(p.softmax_max, p.softmax_max + rows * p.heads_q, -kInf);
    std::fill(p.softmax_sum, p.softmax_sum + rows * p.heads_q, 0.0f);
  }
  if (p.softmax_lse != nullptr) {
    // Rows no task reaches: the sink alone (-inf without sinks), in [B][N2][S1][G] order.
    const int64_t groups = p.heads_q / p.heads_k;
    const int64_t outer = p.layout_query == Layout::kTND ? 1 : p.batch;
    float* at = p.softmax_lse;
    for (int64_t b = 0; b < outer; ++b) {
      for (int64_t g = 0; g < p.heads_k; ++g) {
        for (int64_t i = 0; i < p.seq_q; ++i) {
          for (int64_t r = 0; r < groups; ++r) {
            *at++ = p.sinks != nullptr ? p.sinks[g * groups + r] : -kInf;
          }
        }
      }
    }
  }
  ScratchPool<Forward::Scratch, const Forward> scratch(run, std::max(1, executor.num_workers()));
  if (schedule == nullptr) {
    each_token_and_head(executor, token_tasks(seqs, kTokensPerTask), seqs, scratch,
                        run.kernel_set(), p.heads_k,
                        [&](Forward::Scratch& sc, const Sequence& seq, int64_t i, int64_t g) {
                          run.row(sc, seq, i, g);
                        });
    return;
  }
  // A plan's schedule: each group of items on one worker, then the split rows' combines.
  std::vector<float> slots(schedule->slots * run.slot_floats());
  const std::vector<ScheduledWork>& items = schedule->items;
  const std::vector<int64_t>& ends = schedule->group_ends;
  run_dynamic(executor, static_cast<int64_t>(ends.size()), [&](int64_t w, int worker) {
    Forward::Scratch& sc = scratch[worker];
    const kernels::WorkerScope scope(run.kernel_set());
    for (int64_t t = w == 0 ? 0 : ends[w - 1]; t < ends[w]; ++t) {
      const ScheduledWork& it = items[t];
      const Sequence& seq = seqs[it.b];
      if (it.g < 0) {
        for (int64_t i = it.i0; i < it.i1; ++i) {
          for (int64_t g = 0; g < p.heads_k; ++g) run.row(sc, seq, i, g);
        }
        continue;
      }
      float* slot = it.slot < 0 ? nullptr : slots.data() + it.slot * run.slot_floats();
      run.row(sc, seq, it.i0, it.g, it.k0, it.k1, slot);
    }
  });
  const std::vector<CombineWork>& combines = schedule->combines;
  run_dynamic(executor, static_cast<int64_t>(combines.size()), [&](int64_t t, int worker) {
    const CombineWork& c = combines[t];
    run.combine(scratch[worker], seqs[c.b], c.i, c.g,
                slots.data() + c.first_slot * run.slot_floats(), c.num_slots);
  });
}

}  // namespace sparse

void sparse_flash_attention(const SparseAttentionParams& p, const Executor& executor, Isa isa) {
  validate(p);
  const std::vector<Sequence> seqs = sparse_attention_sequences(p);
  const sparse::IndexedKeys keys(p, seqs);
  sparse::sparse_forward(p, keys, seqs, executor, isa);
}

}  // namespace opmesh::core
