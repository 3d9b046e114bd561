// Shape function of dense_lightning_indexer_softmax_lse for fake tensors and torch.compile.
// Sizes stay symbolic, so dynamic shapes need no recompilation.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "indexer_checks.h"

namespace opmesh::binding {
namespace {

Outputs2 indexer_meta(const IndexerCall& a) {
  check_indexer_args(a);
  const core::Layout parsed = indexer_layout(a.layout);
  const auto options = a.query_index.options().dtype(at::kFloat);
  std::vector<c10::SymInt> shape;
  if (parsed == core::Layout::kTND) {
    shape = {a.key_index.sym_size(1), a.query_index.sym_size(0)};
  } else {
    shape = {a.query_index.sym_size(0), a.key_index.sym_size(2), a.query_index.sym_size(1)};
  }
  return {at::empty_symint(shape, options), at::empty_symint(shape, options)};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, Meta, m) { impl<IndexerCall, indexer_meta>(m); }

}  // namespace opmesh::binding
