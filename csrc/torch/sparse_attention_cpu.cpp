// CPU kernels of sparse_flash_attention and its backward: checks, the core's params, the core on
// PyTorch's thread pool.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "aten_executor.h"
#include "output_memory.h"
#include "sequence_params.h"
#include "sparse_attention_args.h"
#include "torch_access.h"

namespace opmesh::binding {
namespace {

// The call with sparse_indices as int32 and sinks as float32 contiguous, as the core reads them,
// and its host arrays.
template <class Call>
Call prepared(const Call& c, common::HostArrays& host) {
  host = common::host_arrays(c.actual_seq_lengths_query, c.actual_seq_lengths_kv, c.block_table);
  Call p = c;
  if (p.sparse_indices.scalar_type() != at::kInt) p.sparse_indices = p.sparse_indices.to(at::kInt);
  if (p.sinks) p.sinks = p.sinks->to(at::kFloat).contiguous();
  return p;
}

template <class Call>
core::SparseAttentionParams params_of(const Call& c, const common::HostArrays& host) {
  core::SparseAttentionParams p = rethrow([&] { return common::sparse_attention_params(c, host); });
  common::point_sparse_attention(p, c);
  return p;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attention_cpu(
    const SparseFlashAttentionCall& call) {
  TORCH_CHECK_VALUE(call.query.device().is_cpu(), "query: expected a CPU tensor, got ",
                    call.query.device());
  const SparseAttnArgs a = check_sparse_attention_args(call);
  auto [out, smax, ssum] = sparse_attention_outputs(call.query, a, call.return_softmax_lse);
  common::HostArrays host;
  const SparseFlashAttentionCall c = prepared(call, host);
  core::SparseAttentionParams p = params_of(c, host);
  p.out = common::mutable_layout_view(out, a.tnd ? -1 : 0);
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
    cpu_kernels().sparse_flash_attention(p, AtenExecutor());
  });
  return {out, smax, ssum};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
sparse_attention_backward_cpu(const SparseFlashAttentionBackwardCall& call) {
  TORCH_CHECK_VALUE(call.query.device().is_cpu(), "query: expected a CPU tensor, got ",
                    call.query.device());
  const SparseAttnArgs a = check_sparse_attention_args(call);
  TORCH_CHECK_VALUE(!a.paged, "layout_kv: PA_BSND (paged keys and values) has no backward");
  const at::Tensor out_like = std::get<0>(sparse_attention_outputs(call.query, a, false));
  TORCH_CHECK_VALUE(call.dout.sizes() == out_like.sizes(), "dout: expected shape ",
                    out_like.sizes(), ", got ", call.dout.sizes());
  TORCH_CHECK_VALUE(call.attention_out.sizes() == out_like.sizes(),
                    "attention_out: expected shape ", out_like.sizes(), ", got ",
                    call.attention_out.sizes());
  const auto stats = sparse_attention_outputs(call.query, a, true);
  TORCH_CHECK_VALUE(call.softmax_max.sizes() == std::get<1>(stats).sizes(),
                    "softmax_max: expected shape ", std::get<1>(stats).sizes(), ", got ",
                    call.softmax_max.sizes());
  TORCH_CHECK_VALUE(call.softmax_sum.sizes() == std::get<1>(stats).sizes(),
                    "softmax_sum: expected shape ", std::get<1>(stats).sizes(), ", got ",
                    call.softmax_sum.sizes());
  common::HostArrays host;
  SparseFlashAttentionBackwardCall c = prepared(call, host);
  c.dout = c.dout.to(c.query.scalar_type());
  c.attention_out = c.attention_out.to(c.query.scalar_type());
  c.softmax_max = c.softmax_max.to(at::kFloat).contiguous();
  c.softmax_sum = c.softmax_sum.to(at::kFloat).contiguous();
  const auto options = c.query.options();
  const auto f32 = options.dtype(at::kFloat);
  const at::Tensor grads[6] = {
      empty_output(c.query.sizes(), options),
      empty_output(c.key.sizes(), options),
      empty_output(c.value.sizes(), options),
      c.query_rope ? at::empty(c.query_rope->sizes(), options) : at::empty({0}, options),
      c.key_rope ? at::empty(c.key_rope->sizes(), options) : at::empty({0}, options),
      c.sinks ? at::empty({a.n1}, f32) : at::empty({0}, f32)};
  const core::SparseAttentionParams p = params_of(c, host);
  const core::SparseAttentionGrads g = common::sparse_attention_grads(c, a.tnd, grads);
  rethrow([&] {
    if (a.no_heads) return;
    cpu_kernels().sparse_flash_attention_backward(p, g, AtenExecutor());
  });
  const at::Tensor dsinks = call.sinks ? grads[5].to(call.sinks->scalar_type()) : grads[5];
  return {grads[0], grads[1], grads[2], grads[3], grads[4], dsinks};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, CPU, m) {
  impl<SparseFlashAttentionCall, sparse_attention_cpu>(m);
  impl<SparseFlashAttentionBackwardCall, sparse_attention_backward_cpu>(m);
}

}  // namespace opmesh::binding
