// Checks shared by the CPU and Meta kernels of dense_lightning_indexer_softmax_lse: everything
// that can be decided from ranks and argument values without reading tensor data.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string_view>
#include <vector>

#include "checks.h"
#include "core_calls.h"
#include "dtypes.h"
#include "indexer/indexer.h"
#include "op_call.h"
#include "sequence_args.h"

namespace opmesh::binding {

// The indexer family's convention (conventions.h), failures as ValueError.
inline core::Layout indexer_layout(std::string_view layout) {
  return rethrow([&] { return conventions::indexer_layout(layout); });
}

inline core::Mask indexer_mask(int64_t sparse_mode, int64_t pre_tokens, int64_t next_tokens) {
  return rethrow([&] { return conventions::indexer_mask(sparse_mode, pre_tokens, next_tokens); });
}

inline void check_indexer_devices(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w) {
  TORCH_CHECK_VALUE(k.device() == q.device(), "key_index: expected a tensor on ", q.device(),
                    " like query_index, got ", k.device());
  TORCH_CHECK_VALUE(w.device() == q.device(), "weights: expected a tensor on ", q.device(),
                    " like query_index, got ", w.device());
}

inline void check_indexer_ranks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w,
                                core::Layout layout) {
  const bool tnd = layout == core::Layout::kTND;
  const int64_t qk_rank = tnd ? 3 : 4;
  const char* name = tnd ? "TND" : "BSND";
  TORCH_CHECK_VALUE(q.dim() == qk_rank, "query_index: expected a ", qk_rank, "-D ", name,
                    " tensor, got ", q.dim(), "-D with shape ", q.sizes());
  TORCH_CHECK_VALUE(k.dim() == qk_rank, "key_index: expected a ", qk_rank, "-D ", name,
                    " tensor, got ", k.dim(), "-D with shape ", k.sizes());
  TORCH_CHECK_VALUE(w.dim() == qk_rank - 1, "weights: expected a ", qk_rank - 1,
                    "-D tensor for layout ", name, ", got ", w.dim(), "-D with shape ", w.sizes());
}

// Everything shapes, dtypes and argument values decide, for the CPU and Meta kernels alike:
// devices (length tensors too), dtypes, layout and ranks, shapes, size limits, length arrays'
// dtype, rank and entry count.
template <class Call>
void check_indexer_args(const Call& a) {
  const at::Tensor& q = a.query_index;
  const at::Tensor& k = a.key_index;
  const at::Tensor& w = a.weights;
  check_indexer_devices(q, k, w);
  for (const auto& [t, name] : {std::pair{&a.actual_seq_qlen, "actual_seq_qlen"},
                                {&a.actual_seq_klen, "actual_seq_klen"},
                                {&a.cmp_residual_key, "cmp_residual_key"}}) {
    if (t->has_value()) {
      TORCH_CHECK_VALUE((*t)->device() == q.device(), name, ": expected a tensor on ", q.device(),
                        " like query_index, got ", (*t)->device());
    }
  }
  to_core_dtype(q.scalar_type(), "query_index");
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type(), "key_index: expected dtype ",
                   q.scalar_type(), " like query_index, got ", k.scalar_type());
  TORCH_CHECK_TYPE(w.scalar_type() == q.scalar_type() || w.scalar_type() == at::kFloat,
                   "weights: expected dtype ", q.scalar_type(), " or float32, got ",
                   w.scalar_type());
  const core::Layout parsed = indexer_layout(a.layout);
  indexer_mask(a.sparse_mode, a.pre_tokens, a.next_tokens);
  check_indexer_ranks(q, k, w, parsed);
  const bool tnd = parsed == core::Layout::kTND;
  const int off = tnd ? -1 : 0;  // TND has no batch dim
  const int64_t n1 = concrete(q.sym_size(2 + off));
  const int64_t n2 = concrete(k.sym_size(2 + off));
  const int64_t d = concrete(q.sym_size(3 + off));
  // No heads at all (N1 = N2 = 0) is a call with no rows: valid, its outputs empty.
  const bool no_heads = n1 == 0 && n2 == 0;
  TORCH_CHECK_VALUE(no_heads || (n1 >= 1 && n1 <= core::kMaxHeads),
                    "query_index: N1 must be in [1, ", core::kMaxHeads, "], got shape ",
                    q.sym_sizes());
  TORCH_CHECK_VALUE(no_heads || (n2 >= 1 && n2 <= core::kMaxHeads), "key_index: N2 must be in [1, ",
                    core::kMaxHeads, "], got shape ", k.sym_sizes());
  TORCH_CHECK_VALUE(d >= 1 && d <= core::kMaxHeadDim, "query_index: head dim D must be in [1, ",
                    core::kMaxHeadDim, "], got shape ", q.sym_sizes());
  TORCH_CHECK_VALUE(concrete(k.sym_size(3 + off)) == d, "key_index: head dim ", k.sym_size(3 + off),
                    " differs from query_index's ", d);
  TORCH_CHECK_VALUE(no_heads || n1 % n2 == 0, "key_index: query heads N1=", n1,
                    " must be a multiple of key heads N2=", n2);
  for (int64_t dim = 0; dim < w.dim(); ++dim) {
    TORCH_CHECK_VALUE(holds(w.sym_size(dim) == q.sym_size(dim)), "weights: expected shape ",
                      q.sym_sizes().slice(0, w.dim()), " (query_index without D), got ",
                      w.sym_sizes());
  }
  if (!tnd) {
    TORCH_CHECK_VALUE(holds(k.sym_size(0) == q.sym_size(0)), "key_index: batch ", k.sym_size(0),
                      " differs from query_index's ", q.sym_size(0));
  }
  for (const auto& [t, name] : {std::pair{&a.actual_seq_qlen, "actual_seq_qlen"},
                                {&a.actual_seq_klen, "actual_seq_klen"}}) {
    if (!t->has_value()) {
      TORCH_CHECK_VALUE(!tnd, name, ": required for layout TND (cumulative lengths)");
      continue;
    }
    const at::Tensor& lens = **t;
    TORCH_CHECK_TYPE(lens.scalar_type() == at::kInt || lens.scalar_type() == at::kLong, name,
                     ": expected int32 or int64, got ", lens.scalar_type());
    TORCH_CHECK_VALUE(lens.dim() == 1, name, ": expected a 1-D tensor, got shape ", lens.sizes());
    if (!tnd) {
      TORCH_CHECK_VALUE(holds(lens.sym_size(0) == q.sym_size(0)), name, ": expected ",
                        q.sym_size(0), " entries (one per batch), got ", lens.sym_size(0));
    }
  }
  if (tnd) {
    TORCH_CHECK_VALUE(holds(a.actual_seq_klen->sym_size(0) == a.actual_seq_qlen->sym_size(0)),
                      "actual_seq_klen: expected ", a.actual_seq_qlen->sym_size(0),
                      " entries like actual_seq_qlen, got ", a.actual_seq_klen->sym_size(0));
  }
  check_per_sequence(a.cmp_residual_key, "cmp_residual_key",
                     tnd ? a.actual_seq_qlen->sym_size(0) : q.sym_size(0));
}

}  // namespace opmesh::binding
