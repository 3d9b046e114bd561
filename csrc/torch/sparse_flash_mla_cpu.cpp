// CPU kernels of sparse_flash_mla and its backward: checks, the core's params, the core on
// PyTorch's thread pool.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "aten_executor.h"
#include "checks.h"
#include "mla_params.h"
#include "output_memory.h"
#include "sparse_flash_mla_args.h"
#include "torch_access.h"

namespace opmesh::binding {
namespace {

// The call with its selections and topk lengths as int32 and sinks as float32 contiguous, as the
// core reads them.
template <class Call>
Call prepared(const Call& c) {
  Call p = c;
  for (std::optional<at::Tensor>* t :
       {&p.ori_sparse_indices, &p.cmp_sparse_indices, &p.ori_topk_length, &p.cmp_topk_length}) {
    if (t->has_value() && (*t)->scalar_type() != at::kInt) *t = (*t)->to(at::kInt);
  }
  if (p.sinks) p.sinks = p.sinks->to(at::kFloat).contiguous();
  return p;
}

// The core's params of a checked call; with no query heads, the lengths and tables alone.
template <class Call>
core::SparseFlashMlaParams params_of(const Call& c, const common::MlaHost& host, const MlaArgs& a) {
  core::SparseFlashMlaParams p = rethrow([&] { return common::sparse_flash_mla_params(c, host); });
  common::point_sparse_flash_mla(p, c);
  if (a.no_heads) {
    p.heads_q = p.heads_kv = 1;
    p.ori.indices = p.cmp.indices = p.ori.topk_length = p.cmp.topk_length = {};
  }
  return p;
}

Outputs2 sparse_flash_mla_cpu(const SparseFlashMlaCall& call) {
  TORCH_CHECK_VALUE(call.q.device().is_cpu(), "q: expected a CPU tensor, got ", call.q.device());
  const MlaArgs a = check_sparse_flash_mla_args(call);
  auto [out, lse] = sparse_flash_mla_outputs(call.q, a, call.return_softmax_lse);
  const SparseFlashMlaCall c = prepared(call);
  const common::MlaHost host = common::sparse_flash_mla_host(c);
  core::SparseFlashMlaParams p = params_of(c, host, a);
  p.out = common::mutable_layout_view(out, a.tnd ? -1 : 0);
  if (c.return_softmax_lse) p.softmax_lse = lse.data_ptr<float>();
  rethrow([&] {
    if (a.no_heads) return core::validate(p);
    if (!c.metadata.has_value()) return cpu_kernels().sparse_flash_mla(p, AtenExecutor(), nullptr);
    const core::sparse::TokenSchedule planned =
        common::planned_schedule(p, common::host_values(c.metadata));
    cpu_kernels().sparse_flash_mla(p, AtenExecutor(), &planned);
  });
  return {out, lse};
}

at::Tensor sparse_flash_mla_metadata_cpu(const SparseFlashMlaMetadataCall& call) {
  const int64_t workers = call.num_workers.value_or(std::max(1, at::get_num_threads()));
  const core::mla_plan::Plan plan =
      rethrow([&] { return common::sparse_flash_mla_metadata_plan(call, workers); });
  at::Tensor out = at::empty({core::mla_plan::size_words(workers)}, at::kInt);
  core::mla_plan::write(plan, out.data_ptr<int32_t>());
  return out;
}

Outputs4 sparse_flash_mla_backward_cpu(const SparseFlashMlaBackwardCall& call) {
  TORCH_CHECK_VALUE(call.q.device().is_cpu(), "q: expected a CPU tensor, got ", call.q.device());
  const MlaArgs a = check_sparse_flash_mla_args(call);
  TORCH_CHECK_VALUE(!a.paged, "layout_kv: PA_BBND (paged keys) has no backward");
  const at::Tensor lse_like = std::get<1>(sparse_flash_mla_outputs(call.q, a, true));
  for (const auto& [t, name] :
       {std::pair{&call.dout, "dout"}, {&call.attention_out, "attention_out"}}) {
    TORCH_CHECK_VALUE(t->sizes() == call.q.sizes(), name, ": expected shape ", call.q.sizes(),
                      " like q, got ", t->sizes());
  }
  TORCH_CHECK_VALUE(call.softmax_lse.sizes() == lse_like.sizes(), "softmax_lse: expected shape ",
                    lse_like.sizes(), ", got ", call.softmax_lse.sizes());
  TORCH_CHECK_VALUE(!call.dlse || call.dlse->sizes() == lse_like.sizes(), "dlse: expected shape ",
                    lse_like.sizes(), ", got ", call.dlse->sizes());
  SparseFlashMlaBackwardCall c = prepared(call);
  c.dout = c.dout.to(c.q.scalar_type());
  c.attention_out = c.attention_out.to(c.q.scalar_type());
  c.softmax_lse = c.softmax_lse.to(at::kFloat).contiguous();
  if (c.dlse) c.dlse = c.dlse->to(at::kFloat).contiguous();
  const common::MlaHost host = common::sparse_flash_mla_host(c);
  const core::SparseFlashMlaParams p = params_of(c, host, a);
  const auto options = c.q.options();
  const auto f32 = options.dtype(at::kFloat);
  auto like = [&](const std::optional<at::Tensor>& t) {
    return t ? empty_output(t->sizes(), options) : at::empty({0}, options);
  };
  at::Tensor dq = empty_output(c.q.sizes(), options);
  at::Tensor d_ori = like(c.ori_kv);
  at::Tensor d_cmp = like(c.cmp_kv);
  at::Tensor dsinks = c.sinks ? at::empty({a.n1}, f32) : at::empty({0}, f32);
  const at::Tensor outs[4] = {dq, d_ori, d_cmp, dsinks};
  const core::SparseFlashMlaGrads g = common::sparse_flash_mla_grads(c, a.tnd, outs);
  rethrow([&] {
    if (a.no_heads) {
      dq.zero_();
      d_ori.zero_();
      d_cmp.zero_();
      dsinks.zero_();
      return core::validate(p);
    }
    cpu_kernels().sparse_flash_mla_backward(p, g, AtenExecutor());
  });
  if (call.sinks) dsinks = dsinks.to(call.sinks->scalar_type());
  return {dq, d_ori, d_cmp, dsinks};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, CPU, m) {
  impl<SparseFlashMlaCall, sparse_flash_mla_cpu>(m);
  impl<SparseFlashMlaBackwardCall, sparse_flash_mla_backward_cpu>(m);
}

// Called with no tensor at all, the plan has no backend to follow: it is a host-side plan.
TORCH_LIBRARY_IMPL(opmesh, CompositeExplicitAutograd, m) {
  impl<SparseFlashMlaMetadataCall, sparse_flash_mla_metadata_cpu>(m);
}

}  // namespace opmesh::binding
