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

class Geometry {
 public:
  explicit Geometry(const SparseAttentionParams& p)
      : p_(p),
        seqs_(sparse_attention_sequences(p)),
        mask_(indexer_mask(p.sparse_mode, p.pre_tokens, p.next_tokens)),
        groups_(p.heads_q / p.heads_k) {}

  const std::vector<Sequence>& sequences() const { return seqs_; }
  int64_t groups() const { return groups_; }

  // Offset of query-layout row (b, i, head) for a tensor with these strides.
  template <class V>  // View or MutableView
  int64_t query_offset(const V& st, const Sequence& s, int64_t i, int64_t head) const {
    const int64_t base = p_.layout_query == Layout::kTND ? 0 : s.batch * st.sb;
    return base + (s.q_begin + i) * st.ss + head * st.sn;
  }

  // Offset of key-layout row (b, j, g).
  template <class V>
  int64_t key_offset(const V& st, const Sequence& s, int64_t j, int64_t g) const {
    if (p_.layout_kv == Layout::kPagedBBND) {
      const int64_t block = p_.block_table[s.batch * p_.max_blocks + j / p_.block_size];
      return block * st.sb + (j % p_.block_size) * st.ss + g * st.sn;
    }
    const int64_t base = p_.layout_kv == Layout::kTND ? 0 : s.batch * st.sb;
    return base + (s.k_begin + j) * st.ss + g * st.sn;
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

  // The key positions row (s, i) selects for key head g, in index order then key order: each
  // index v >= 0 picks [v * bs, (v + 1) * bs) within the sequence and the row's visible keys.
  void select(const Sequence& s, int64_t i, int64_t g, std::vector<int32_t>& out) const {
    out.clear();
    const KeyRange vis = visible_keys(mask_, s, i);
    if (vis.end <= vis.begin) return;
    const View& st = p_.indices;
    const int32_t* indices = static_cast<const int32_t*>(st.data);
    const int64_t n = p_.index_heads == 1 ? 0 : g;
    const int64_t base = (p_.layout_query == Layout::kTND ? 0 : s.batch * st.sb) +
                         (s.q_begin + i) * st.ss + n * st.sn;
    const int64_t bs = p_.sparse_block_size;
    for (int64_t e = 0; e < p_.sparse_count; ++e) {
      const int64_t v = indices[base + e * st.sd];
      if (v < 0) continue;
      const int64_t lo = std::max(v * bs, vis.begin);
      const int64_t hi = std::min((v + 1) * bs, vis.end);
      for (int64_t j = lo; j < hi; ++j) out.push_back(static_cast<int32_t>(j));
    }
  }

 private:
  const SparseAttentionParams& p_;
  std::vector<Sequence> seqs_;
  Mask mask_;
  int64_t groups_;
};

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
