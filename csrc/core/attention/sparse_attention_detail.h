// What sparse attention's forward and backward share: element offsets of a token's rows in every
// layout, and the keys one selection row picks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../kernels/kernel_set.h"
#include "../kernels/row_loads.h"
#include "../selection.h"
#include "../work_split.h"
#include "sparse_attention.h"

namespace opmesh::core::sparse {

// Runs fn(scratch, sequence, token, key head) for every token of every task and every key head,
// a task at a time per worker with that worker's scratch and the kernel set's worker scope.
template <class Pool, class Fn>
void each_token_and_head(const Executor& executor, const std::vector<TokenTask>& tasks,
                         const std::vector<Sequence>& seqs, Pool& scratch,
                         const kernels::KernelSet& set, int64_t heads, Fn fn) {
  run_dynamic(executor, static_cast<int64_t>(tasks.size()), [&](int64_t t, int worker) {
    auto& sc = scratch[worker];
    const kernels::WorkerScope scope(set);
    const TokenTask& task = tasks[t];
    for (int64_t i = task.i0; i < task.i1; ++i) {
      for (int64_t g = 0; g < heads; ++g) fn(sc, seqs[task.b], i, g);
    }
  });
}

// The query side of a sparse call: where a token's rows, output row and statistics are.
class QueryGeometry {
 public:
  explicit QueryGeometry(const SparseAttentionParams& p) : p_(p), groups_(p.heads_q / p.heads_k) {}

  int64_t groups() const { return groups_; }

  // Offset of query-layout row (b, i, head) for a tensor with these strides.
  template <class V>  // View or MutableView
  int64_t query_offset(const V& st, const Sequence& s, int64_t i, int64_t head) const {
    const int64_t base = p_.layout_query == Layout::kTND ? 0 : s.batch * st.sb;
    return base + (s.q_begin + i) * st.ss + head * st.sn;
  }

  // The output row of token i of s: BSND b * S1 + i, TND q_begin + i.
  int64_t token(const Sequence& s, int64_t i) const {
    return p_.layout_query == Layout::kTND ? s.q_begin + i : s.batch * p_.seq_q + i;
  }

  // Statistics offset of (token, g, head-in-group 0): [B, N2, S1, G] / [N2, T1, G].
  int64_t stats_offset(const Sequence& s, int64_t i, int64_t g) const {
    if (p_.layout_query == Layout::kTND) return (g * p_.seq_q + s.q_begin + i) * groups_;
    return ((s.batch * p_.heads_k + g) * p_.seq_q + i) * groups_;
  }

 private:
  const SparseAttentionParams& p_;
  int64_t groups_;
};

// A tensor of keys: the key rows (with their rope part, when the call has one) and the value
// rows the same positions hold. Shared key/value attention names one view twice.
struct KeySource {
  View key;
  View rope;
  View value;
  // A quantized key and value (one byte per element): their row scales (float32).
  CacheFormat format = CacheFormat::kPlain;
  View key_scale, value_scale;
};

// One key a query row selects: its source, its position in that source's sequence, and the
// element offsets of its rows in the source's key, rope and value views.
struct KeyRef {
  int32_t source;
  int32_t j;
  int64_t key;
  int64_t rope;
  int64_t value;
  float key_scale = 1.0f;  // a quantized source's row scales
  float value_scale = 1.0f;
};

// Keys [j0, j1) of source k: the part of each row's selection one key block of the backward
// takes.
struct KeyWindow {
  int source;
  int64_t j0, j1;

  // The visible range vis of source k cut to the window (empty for another source).
  KeyRange cut(int k, const KeyRange& vis) const {
    if (k != source) return {0, 0};
    return {std::max(vis.begin, j0), std::min(vis.end, j1)};
  }
};

// Which keys each query row attends to, and where their gradients go: what sparse_flash_attention
// (one key tensor, sparse_indices) and sparse_flash_mla (a window of ori_kv and cmp_kv's entries)
// tell the shared forward and backward.
class KeySelector {
 public:
  virtual ~KeySelector() = default;
  virtual int num_sources() const = 0;
  virtual const KeySource& source(int k) const = 0;
  // Source k's sequences, indexed like the query sequences (by Sequence::batch).
  virtual const std::vector<Sequence>& key_sequences(int k) const = 0;
  // The keys row (s, i) selects for key head g, in selection order, no key twice; with a
  // window, only those of its source within its positions (in the same order).
  virtual void select(const Sequence& s, int64_t i, int64_t g, const KeyWindow* window,
                      std::vector<KeyRef>& out) const = 0;
  // False only when row (s, i) selects none of keys [j0, j1) of source k.
  virtual bool may_select(const Sequence& s, int64_t i, int k, int64_t j0, int64_t j1) const = 0;
  // Writes key j's gradients (key part dqk floats: key | rope; value part dv floats) of source
  // k's sequence ks, key head g.
  virtual void store_grads(const kernels::KernelSet& set, int k, const Sequence& ks, int64_t j,
                           int64_t g, const float* dkey, const float* dvalue) const = 0;
};

// The element offset of row (s, j, g) of a key-layout tensor with strides st: BSND and TND by
// position (k_begin + j), paged through the block table ([B][max_blocks] row-major).
template <class V>
int64_t key_row_offset(const V& st, Layout layout, const Sequence& s, int64_t j, int64_t g,
                       const int64_t* block_table, int64_t max_blocks, int64_t block_size) {
  if (layout == Layout::kPagedBBND) {
    const int64_t block = block_table[s.batch * max_blocks + j / block_size];
    return block * st.sb + (j % block_size) * st.ss + g * st.sn;
  }
  const int64_t base = layout == Layout::kTND ? 0 : s.batch * st.sb;
  return base + (s.k_begin + j) * st.ss + g * st.sn;
}

// Appends to out the entries of one selection row (`count` int32 entries from `base`, `stride`
// apart), each index v >= 0 naming keys [v * bs, (v + 1) * bs) kept within [vis.begin, vis.end).
template <class Add>
void each_selected(const int32_t* indices, int64_t base, int64_t stride, int64_t count, int64_t bs,
                   const KeyRange& vis, Add add) {
  for (int64_t e = 0; e < count; ++e) {
    const int64_t v = indices[base + e * stride];
    if (v < 0) continue;
    const int64_t lo = std::max(v * bs, vis.begin);
    const int64_t hi = std::min((v + 1) * bs, vis.end);
    for (int64_t j = lo; j < hi; ++j) add(j);
  }
}

// sparse_flash_attention's selection: sparse_indices' blocks within the band, from key, key_rope
// and value; gradients written contiguous in the key tensors' shapes.
class IndexedKeys final : public KeySelector {
 public:
  IndexedKeys(const SparseAttentionParams& p, const std::vector<Sequence>& seqs,
              const SparseAttentionGrads* grads = nullptr)
      : p_(p),
        seqs_(seqs),
        mask_(indexer_mask(p.sparse_mode, p.pre_tokens, p.next_tokens)),
        grads_(grads),
        source_{p.key, p.key_rope, p.value, p.kv_format, p.key_scale, p.value_scale} {}

  int num_sources() const override { return 1; }
  const KeySource& source(int) const override { return source_; }
  const std::vector<Sequence>& key_sequences(int) const override { return seqs_; }

  void select(const Sequence& s, int64_t i, int64_t g, const KeyWindow* window,
              std::vector<KeyRef>& out) const override {
    out.clear();
    KeyRange vis = visible_keys(mask_, s, i);
    if (window != nullptr) vis = window->cut(0, vis);
    if (vis.end <= vis.begin) return;
    const View& st = p_.indices;
    const int64_t n = p_.index_heads == 1 ? 0 : g;
    const int64_t base = (p_.layout_query == Layout::kTND ? 0 : s.batch * st.sb) +
                         (s.q_begin + i) * st.ss + n * st.sn;
    each_selected(static_cast<const int32_t*>(st.data), base, st.sd, p_.sparse_count,
                  p_.sparse_block_size, vis, [&](int64_t j) {
                    const int64_t ro = p_.rope_dim > 0 ? offset(p_.key_rope, s, j, g) : 0;
                    out.push_back({0, static_cast<int32_t>(j), offset(p_.key, s, j, g), ro,
                                   offset(p_.value, s, j, g)});
                    if (p_.kv_format != CacheFormat::kPlain) {
                      out.back().key_scale = scale_at(p_.key_scale, s, j, g);
                      out.back().value_scale = scale_at(p_.value_scale, s, j, g);
                    }
                  });
  }

  bool may_select(const Sequence& s, int64_t i, int, int64_t j0, int64_t j1) const override {
    const KeyRange vis = visible_keys(mask_, s, i);
    return vis.end > j0 && vis.begin < j1 && vis.end > vis.begin;
  }

  void store_grads(const kernels::KernelSet& set, int, const Sequence& ks, int64_t j, int64_t g,
                   const float* dkey, const float* dvalue) const override {
    const int64_t row =
        (p_.layout_kv == Layout::kTND ? ks.k_begin + j : ks.batch * p_.seq_k + j) * p_.heads_k + g;
    store_row(set, grads_->dk, p_.dtype, row * p_.head_dim, 1, p_.head_dim, dkey, 1.0f);
    if (p_.rope_dim > 0) {
      store_row(set, grads_->dk_rope, p_.dtype, row * p_.rope_dim, 1, p_.rope_dim,
                dkey + p_.head_dim, 1.0f);
    }
    store_row(set, grads_->dv, p_.dtype, row * p_.value_dim, 1, p_.value_dim, dvalue, 1.0f);
  }

 private:
  int64_t offset(const View& st, const Sequence& s, int64_t j, int64_t g) const {
    return key_row_offset(st, p_.layout_kv, s, j, g, p_.block_table, p_.max_blocks, p_.block_size);
  }

  float scale_at(const View& st, const Sequence& s, int64_t j, int64_t g) const {
    return static_cast<const float*>(st.data)[offset(st, s, j, g)];
  }

  const SparseAttentionParams& p_;
  const std::vector<Sequence>& seqs_;
  Mask mask_;
  const SparseAttentionGrads* grads_;
  KeySource source_;
};

// The next chunk of a row's selected keys asked for from memory while the current chunk's rows
// load, a few lines per loaded row (`steps` of them): the selection gathers rows from anywhere in
// the key tensors, a pattern the hardware prefetchers do not follow. Rows read with a stride are
// not asked for, and a shared key/value row once.
class ChunkAhead {
 public:
  // (A quantized source's key and value rows take one byte per element.)
  ChunkAhead(const KeySelector& keys, const KeyRef* next, int64_t n, int64_t elem_bytes,
             int64_t key_dim, int64_t rope_dim, int64_t value_dim, int64_t steps) {
    int64_t counts[3] = {0, 0, 0};
    int64_t bytes[3] = {elem_bytes, elem_bytes, elem_bytes};
    for (int64_t c = 0; c < n; ++c) {
      const KeySource& src = keys.source(next[c].source);
      const int64_t kv_bytes = src.format == CacheFormat::kPlain ? elem_bytes : 1;
      bytes[0] = bytes[2] = kv_bytes;
      add(src.key, next[c].key, kv_bytes, counts[0], rows_[0]);
      if (rope_dim > 0) add(src.rope, next[c].rope, elem_bytes, counts[1], rows_[1]);
      const bool shared = src.value.data == src.key.data && next[c].value == next[c].key;
      if (!shared) add(src.value, next[c].value, kv_bytes, counts[2], rows_[2]);
    }
    const int64_t dims[3] = {key_dim, rope_dim, value_dim};
    for (int t = 0; t < 3; ++t) {
      lines_[t] = kernels::LinesAhead({rows_[t], counts[t], dims[t] * bytes[t]}, steps);
    }
  }

  void next() {
    for (kernels::LinesAhead& l : lines_) l.next();
  }

 private:
  static void add(const View& v, int64_t offset, int64_t elem_bytes, int64_t& count,
                  const char** rows) {
    if (v.sd != 1) return;
    rows[count++] = static_cast<const char*>(v.data) + offset * elem_bytes;
  }

  const char* rows_[3][kernels::kKeyTile];  // key, rope and value rows
  kernels::LinesAhead lines_[3];
};

// The shared kernels. `p` gives the query side, the heads, dims, scale, sinks and outputs (its
// key-side fields are the selector's business); `seqs` are the query sequences.
// A planned forward's work: for each worker, a list of items, each rows [i0, i1) of sequence b
// with every key head (g < 0), or row i0 of one key head g over its selected keys [k0, k1)
// (k1 < 0: to the last), written out (slot < 0) or kept as a partial result in `slot`; then
// the split rows' partial results merged in slot order.
struct ScheduledWork {
  int32_t b = 0;
  int64_t i0 = 0, i1 = 0;
  int32_t g = -1;
  int64_t k0 = 0, k1 = -1;
  int32_t slot = -1;
};
struct CombineWork {
  int32_t b = 0;
  int64_t i = 0;
  int32_t g = 0;
  int32_t first_slot = 0;
  int32_t num_slots = 0;
};
struct TokenSchedule {
  std::vector<ScheduledWork> items;
  std::vector<int64_t> group_ends;  // each worker's end in items
  std::vector<CombineWork> combines;
  int64_t slots = 0;
};
void sparse_forward(const SparseAttentionParams& p, const KeySelector& keys,
                    const std::vector<Sequence>& seqs, const Executor& executor, Isa isa,
                    const TokenSchedule* schedule = nullptr);
void sparse_backward(const SparseAttentionParams& p, const SparseAttentionGrads& grads,
                     const KeySelector& keys, const std::vector<Sequence>& seqs,
                     const Executor& executor, Isa isa);

// The rows of a gradient the backward's passes write: each sequence's query rows (BSND b * S1,
// TND q_begin, q_len of them) or, with `keys`, its key rows (BSND b * seq, TND k_begin, k_len).
struct RowSpan {
  int64_t begin, count;
};
std::vector<RowSpan> written_rows(const std::vector<Sequence>& seqs, Layout layout, int64_t seq,
                                  bool keys);
// Zeroes the rows of dst ([rows][width] elements of dtype) outside the spans: what no pass
// reaches (BSND rows past a length). All-zero bits are 0 in every dtype.
void zero_unwritten_rows(void* dst, DType dtype, int64_t rows, int64_t width,
                         std::vector<RowSpan> written);

// Reading the selected rows where they lie, on a pair set with gemm_rows (the forward's and the
// backward's products instead of copying and packing a chunk of 64 selected rows first).
// Whether the rows allow it: bf16 rows of unit stride from plain (not quantized) sources, whole
// pair words on each side of the key | rope join; value_dim_multiple: what the caller's value
// product needs of the value width.
bool rows_in_place(const SparseAttentionParams& p, const KeySelector& keys,
                   const kernels::KernelSet& k, int64_t value_dim_multiple);

// One operand of gathered_product: n rows (addresses), `words` pair words each, against the
// group's rows transposed (bt: [words][64] per 64 rows of the group, chunk_words apart).
struct GatheredPart {
  const void* const* rows;
  int64_t words;
  const uint32_t* bt;
};

// out[r][c] = alpha sum over the parts of row c . group row r, for n <= 64 gathered rows c and
// r < g ([g][64], as the packed product leaves it; columns past n zero): S^T = A B^T on the rows
// where they lie (gemm_rows, one part after the other, later ones added), then transposed. st:
// [64][round_up(g, 16)] floats; ones: 64 ones. One part: the packed product's pair products in
// the same order, the same bits. `ahead`: rows asked for from memory during the first part's
// product (rows_ahead.h).
void gathered_product(const kernels::KernelSet& k, const GatheredPart* parts, int count, int64_t n,
                      int64_t g, int64_t chunk_words, float alpha, float* st, const float* ones,
                      float* out, const kernels::RowsAhead& ahead = {});

// Whether a bf16 query-layout tensor's rows of `elements` elements are whole pair words where
// they lie: unit stride along the row, an even element count, even strides and 4-byte aligned
// data (a group's rows then are pair words heads.sn / 2 apart, read with no copy).
inline bool words_in_place(const View& v, int64_t elements) {
  return v.data != nullptr && v.sd == 1 && elements % 2 == 0 && v.sb % 2 == 0 && v.ss % 2 == 0 &&
         v.sn % 2 == 0 && reinterpret_cast<uintptr_t>(v.data) % 4 == 0;
}

// The group's g rows (`words` pair words, ld apart) transposed per 64 rows into bt ([words][64]
// per 64 rows, words * 64 apart): gathered_product's B operand.
void transpose_group(const kernels::KernelSet& k, const uint32_t* rows, int64_t g, int64_t ld,
                     int64_t words, uint32_t* bt);

// Copies n bf16 elements (stride `stride`) at element `offset` of `base` as they are.
inline void copy_bf16(const void* base, int64_t offset, int64_t stride, int64_t n, uint16_t* dst) {
  const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
  if (stride == 1) {
    std::memcpy(dst, src, n * sizeof(uint16_t));
  } else {
    for (int64_t e = 0; e < n; ++e) dst[e] = src[e * stride];
  }
}

// Loads n elements (stride `stride`) at element `offset` of `base` as float: contiguous rows
// through the kernel set's conversion, others element by element.
inline void load(const kernels::KernelSet& set, const void* base, DType dtype, int64_t offset,
                 int64_t stride, int64_t n, float* dst) {
  if (stride == 1) {
    set.widen(static_cast<const char*>(base) + offset * dtype_size(dtype), dtype, n, dst);
  } else {
    load_row(base, dtype, offset, stride, n, dst);
  }
}

}  // namespace opmesh::core::sparse
