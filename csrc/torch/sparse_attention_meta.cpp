// Shape functions of sparse_flash_attention and its backward for fake tensors and torch.compile.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "sparse_attention_args.h"

namespace opmesh::binding {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attention_meta(
    const SparseFlashAttentionCall& c) {
  return sparse_attention_outputs(c.query, check_sparse_attention_args(c), c.return_softmax_lse);
}

at::Tensor like(const at::Tensor& t, const at::Tensor& options_of) {
  return at::empty_symint(t.sym_sizes(), options_of.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
sparse_attention_backward_meta(const SparseFlashAttentionBackwardCall& c) {
  const SparseAttnArgs a = check_sparse_attention_args(c);
  TORCH_CHECK_VALUE(!a.paged, "layout_kv: PA_BSND (paged keys and values) has no backward");
  const auto f32 = c.query.options().dtype(at::kFloat);
  return {like(c.query, c.query),
          like(c.key, c.key),
          like(c.value, c.value),
          c.query_rope ? like(*c.query_rope, c.query) : at::empty({0}, c.query.options()),
          c.key_rope ? like(*c.key_rope, c.query) : at::empty({0}, c.query.options()),
          c.sinks ? at::empty({a.n1}, c.sinks->options()) : at::empty({0}, f32)};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, Meta, m) {
  impl<SparseFlashAttentionCall, sparse_attention_meta>(m);
  impl<SparseFlashAttentionBackwardCall, sparse_attention_backward_meta>(m);
}

}  // namespace opmesh::binding
