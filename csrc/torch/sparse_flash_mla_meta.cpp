// Shape functions of sparse_flash_mla and its backward for fake tensors and torch.compile.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "sparse_flash_mla_args.h"

namespace opmesh::binding {
namespace {

Outputs2 sparse_flash_mla_meta(const SparseFlashMlaCall& c) {
  return sparse_flash_mla_outputs(c.q, check_sparse_flash_mla_args(c), c.return_softmax_lse);
}

Outputs4 sparse_flash_mla_backward_meta(const SparseFlashMlaBackwardCall& c) {
  const MlaArgs a = check_sparse_flash_mla_args(c);
  TORCH_CHECK_VALUE(!a.paged, "layout_kv: PA_BBND (paged keys) has no backward");
  auto like = [&](const std::optional<at::Tensor>& t) {
    return t ? at::empty_symint(t->sym_sizes(), c.q.options()) : at::empty({0}, c.q.options());
  };
  const auto f32 = c.q.options().dtype(at::kFloat);
  return {at::empty_symint(c.q.sym_sizes(), c.q.options()), like(c.ori_kv), like(c.cmp_kv),
          c.sinks ? at::empty({a.n1}, c.sinks->options()) : at::empty({0}, f32)};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, Meta, m) {
  impl<SparseFlashMlaCall, sparse_flash_mla_meta>(m);
  impl<SparseFlashMlaBackwardCall, sparse_flash_mla_backward_meta>(m);
}

}  // namespace opmesh::binding
