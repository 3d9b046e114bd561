// CPU kernels of sparse_flash_attention and its backward: checks, the core's params, the core on
// PyTorch's thread pool.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "aten_executor.h"
#include "sparse_attention_args.h"

namespace opmesh::binding {
namespace {

void out_strides(const at::Tensor& t, bool tnd, int64_t* dst) {
  const int64_t off = tnd ? -1 : 0;
  for (int64_t i = 0; i < 4; ++i) dst[i] = i + off >= 0 ? t.stride(i + off) : 0;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attention_cpu(
    const SparseFlashAttentionCall& c) {
  TORCH_CHECK_VALUE(c.query.device().is_cpu(), "query: expected a CPU tensor, got ",
                    c.query.device());
  const SparseAttnArgs a = check_sparse_attention_args(c);
  auto [out, smax, ssum] = sparse_attention_outputs(c.query, a, c.return_softmax_lse);
  SparseAttnHost host;
  core::SparseAttentionParams p = sparse_attention_params(c, a, host);
  p.out = out.data_ptr();
  out_strides(out, a.tnd, p.out_stride);
  if (c.return_softmax_lse) {
    p.softmax_max = smax.data_ptr<float>();
    p.softmax_sum = ssum.data_ptr<float>();
  }
  rethrow([&] {
    if (a.no_heads) {
      // No rows to read: the lengths, table and band are still checked as with heads.
      p.heads_q = p.heads_k = p.index_heads = 1;
      p.sparse_count = 0;
      core::validate(p);
      return;
    }
    core::sparse_flash_attention(p, AtenExecutor(), core::active_isa());
  });
  return {out, smax, ssum};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
sparse_attention_backward_cpu(const SparseFlashAttentionBackwardCall& c) {
  TORCH_CHECK_VALUE(c.query.device().is_cpu(), "query: expected a CPU tensor, got ",
                    c.query.device());
  const SparseAttnArgs a = check_sparse_attention_args(c);
  TORCH_CHECK_VALUE(!a.paged, "layout_kv: PA_BSND (paged keys and values) has no backward");
  const at::Tensor out_like = std::get<0>(sparse_attention_outputs(c.query, a, false));
  TORCH_CHECK_VALUE(c.dout.sizes() == out_like.sizes(), "dout: expected shape ", out_like.sizes(),
                    ", got ", c.dout.sizes());
  TORCH_CHECK_VALUE(c.attention_out.sizes() == out_like.sizes(), "attention_out: expected shape ",
                    out_like.sizes(), ", got ", c.attention_out.sizes());
  const auto stats = sparse_attention_outputs(c.query, a, true);
  TORCH_CHECK_VALUE(c.softmax_max.sizes() == std::get<1>(stats).sizes(),
                    "softmax_max: expected shape ", std::get<1>(stats).sizes(), ", got ",
                    c.softmax_max.sizes());
  TORCH_CHECK_VALUE(c.softmax_sum.sizes() == std::get<1>(stats).sizes(),
                    "softmax_sum: expected shape ", std::get<1>(stats).sizes(), ", got ",
                    c.softmax_sum.sizes());
  const at::Tensor dout = c.dout.to(c.query.scalar_type());
  const at::Tensor smax = c.softmax_max.to(at::kFloat).contiguous();
  const at::Tensor ssum = c.softmax_sum.to(at::kFloat).contiguous();
  at::Tensor dq = at::empty(c.query.sizes(), c.query.options());
  at::Tensor dk = at::empty(c.key.sizes(), c.key.options());
  at::Tensor dv = at::empty(c.value.sizes(), c.value.options());
  at::Tensor dqr = c.query_rope ? at::empty(c.query_rope->sizes(), c.query.options())
                                : at::empty({0}, c.query.options());
  at::Tensor dkr = c.key_rope ? at::empty(c.key_rope->sizes(), c.query.options())
                              : at::empty({0}, c.query.options());
  at::Tensor dsinks = c.sinks ? at::empty({a.n1}, c.query.options().dtype(at::kFloat))
                              : at::empty({0}, c.query.options().dtype(at::kFloat));
  SparseAttnHost host;
  core::SparseAttentionParams p = sparse_attention_params(c, a, host);
  core::SparseAttentionGrads g;
  g.dout = dout.data_ptr();
  out_strides(dout, a.tnd, g.dout_stride);
  const at::Tensor out = c.attention_out.to(c.query.scalar_type());
  g.out = out.data_ptr();
  out_strides(out, a.tnd, g.out_stride);
  g.softmax_max = smax.data_ptr<float>();
  g.softmax_sum = ssum.data_ptr<float>();
  g.dq = dq.data_ptr();
  g.dk = dk.data_ptr();
  g.dv = dv.data_ptr();
  if (c.query_rope) {
    g.dq_rope = dqr.data_ptr();
    g.dk_rope = dkr.data_ptr();
  }
  g.dsinks = c.sinks ? dsinks.data_ptr<float>() : nullptr;
  rethrow([&] {
    if (a.no_heads) return;
    core::sparse_flash_attention_backward(p, g, AtenExecutor(), core::active_isa());
  });
  if (c.sinks) dsinks = dsinks.to(c.sinks->scalar_type());
  return {dq, dk, dv, dqr, dkr, dsinks};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, CPU, m) {
  impl<SparseFlashAttentionCall, sparse_attention_cpu>(m);
  impl<SparseFlashAttentionBackwardCall, sparse_attention_backward_cpu>(m);
}

}  // namespace opmesh::binding
