// Checks shared by the CPU and Meta kernels of dense_lightning_indexer_softmax_lse: everything
// that can be decided from ranks and argument values without reading tensor data.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string_view>

#include "indexer.h"

namespace opmesh::binding {

inline core::Layout indexer_layout(std::string_view layout) {
  if (layout == "BSND") return core::Layout::kBSND;
  if (layout == "TND") return core::Layout::kTND;
  TORCH_CHECK_VALUE(false, "layout: expected 'BSND' or 'TND', got '", layout, "'");
}

inline core::SparseMode indexer_sparse_mode(int64_t mode) {
  TORCH_CHECK_VALUE(mode == 0 || mode == 3,
                    "sparse_mode: expected 0 (no mask) or 3 (causal, bottom-right), got ", mode);
  return static_cast<core::SparseMode>(mode);
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

}  // namespace opmesh::binding
