// Shape function of dense_lightning_indexer_softmax_lse for fake tensors and torch.compile.
// Sizes stay symbolic, so dynamic shapes need no recompilation.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "indexer_checks.h"

namespace opmesh::binding {
namespace {

std::tuple<at::Tensor, at::Tensor> indexer_meta(const at::Tensor& query_index,
                                                const at::Tensor& key_index,
                                                const at::Tensor& weights,
                                                const std::optional<at::Tensor>& actual_seq_qlen,
                                                const std::optional<at::Tensor>& actual_seq_klen,
                                                c10::string_view layout, int64_t sparse_mode,
                                                int64_t pre_tokens, int64_t next_tokens) {
  check_indexer_args(query_index, key_index, weights, actual_seq_qlen, actual_seq_klen, layout,
                     sparse_mode, pre_tokens, next_tokens);
  const core::Layout parsed = indexer_layout(layout);
  const auto options = query_index.options().dtype(at::kFloat);
  std::vector<c10::SymInt> shape;
  if (parsed == core::Layout::kTND) {
    shape = {key_index.sym_size(1), query_index.sym_size(0)};
  } else {
    shape = {query_index.sym_size(0), key_index.sym_size(2), query_index.sym_size(1)};
  }
  return {at::empty_symint(shape, options), at::empty_symint(shape, options)};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, Meta, m) {
  m.impl("dense_lightning_indexer_softmax_lse", &indexer_meta);
}

}  // namespace opmesh::binding
