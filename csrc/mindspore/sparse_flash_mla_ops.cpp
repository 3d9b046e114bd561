// sparse_flash_mla and its backward on MindSpore tensors: the shapes were checked by the shared
// torch shape functions in Python (selections and topk lengths arrive as int32, sinks as
// float32); the core checks the values, plans when given metadata, and computes.
#include <memory>
#include <vector>

#include "attention/sparse_flash_mla.h"
#include "cpu_features.h"
#include "mla_params.h"
#include "ms_call.h"

namespace opmesh::ms_binding {
namespace {

template <class Call>
void resolve_all(const Call& c) {
  resolve({&c.q});
  for (const auto* t : {&c.ori_kv, &c.cmp_kv, &c.ori_sparse_indices, &c.cmp_sparse_indices,
                        &c.ori_topk_length, &c.cmp_topk_length, &c.sinks}) {
    resolve(*t);
  }
}

// The core's params of a call, without tensor pointers (added in the runner), and the host
// arrays they point into.
template <class Call>
core::SparseFlashMlaParams base_params(const Call& c, std::shared_ptr<common::MlaHost>& host) {
  resolve_all(c);
  host = std::make_shared<common::MlaHost>(common::sparse_flash_mla_host(c));
  return checked([&] { return common::sparse_flash_mla_params(c, *host); });
}

// The lse's shape: [B, N2, S1, G] / [N2, T1, G].
std::vector<int64_t> lse_shape(const core::SparseFlashMlaParams& p) {
  const int64_t g = p.heads_q / p.heads_kv;
  if (p.layout_q == core::Layout::kTND) return {p.heads_kv, p.seq_q, g};
  return {p.batch, p.heads_kv, p.seq_q, g};
}

// With no query heads nothing is computed; the lengths and tables are still checked.
bool no_heads(const core::SparseFlashMlaParams& base) {
  if (base.heads_q != 0) return false;
  core::SparseFlashMlaParams p = base;
  p.heads_q = p.heads_kv = 1;
  checked([&] {
    core::validate(p);
    return 0;
  });
  return true;
}

}  // namespace

py::object sparse_flash_mla(const SparseFlashMlaCall& call) {
  std::shared_ptr<common::MlaHost> host;
  const core::SparseFlashMlaParams base = base_params(call, host);
  const bool empty = no_heads(base);
  const bool tnd = base.layout_q == core::Layout::kTND;
  auto metadata = std::make_shared<std::vector<int64_t>>(
      values_of(call.metadata).value_or(std::vector<int64_t>{}));
  const bool planned = call.metadata.has_value();
  const std::vector<OutputSpec> outs{
      {call.q.data_type(), call.q.shape()},
      {mindspore::kNumberTypeFloat32, empty ? std::vector<int64_t>{0} : lse_shape(base)}};
  return launch("OpmeshSparseFlashMla", inputs_of(call), outs,
                [call, base, host, metadata, planned, empty, tnd](const std::vector<ms::Tensor>& in,
                                                                  std::vector<ms::Tensor>& out) {
                  if (empty) return;
                  core::SparseFlashMlaParams p = base;
                  common::point_sparse_flash_mla(p, with_inputs(call, in));
                  p.out = common::mutable_layout_view(out[0], tnd ? -1 : 0);
                  p.softmax_lse = out[1].data_ptr<float>();
                  checked([&] {
                    if (!planned) {
                      cpu_kernels().sparse_flash_mla(p, ThreadExecutor(), nullptr);
                      return 0;
                    }
                    const core::sparse::TokenSchedule schedule =
                        common::planned_schedule(p, *metadata);
                    cpu_kernels().sparse_flash_mla(p, ThreadExecutor(), &schedule);
                    return 0;
                  });
                });
}

py::object sparse_flash_mla_backward(const SparseFlashMlaBackwardCall& call) {
  resolve({&call.dout, &call.attention_out, &call.softmax_lse});
  resolve(call.dlse);
  std::shared_ptr<common::MlaHost> host;
  const core::SparseFlashMlaParams base = base_params(call, host);
  const bool empty = no_heads(base);
  const auto dtype = call.q.data_type();
  auto shape_or_empty = [](const std::optional<ms::Tensor>& t) {
    return t.has_value() ? t->shape() : std::vector<int64_t>{0};
  };
  const std::vector<OutputSpec> outs{
      {dtype, call.q.shape()},
      {dtype, shape_or_empty(call.ori_kv)},
      {dtype, shape_or_empty(call.cmp_kv)},
      {mindspore::kNumberTypeFloat32,
       call.sinks.has_value() ? std::vector<int64_t>{base.heads_q} : std::vector<int64_t>{0}}};
  const bool tnd = base.layout_q == core::Layout::kTND;
  return launch("OpmeshSparseFlashMlaGrad", inputs_of(call), outs,
                [call, base, host, empty, tnd](const std::vector<ms::Tensor>& in,
                                               std::vector<ms::Tensor>& out) {
                  if (empty) return;
                  const SparseFlashMlaBackwardCall c = with_inputs(call, in);
                  core::SparseFlashMlaParams p = base;
                  common::point_sparse_flash_mla(p, c);
                  const ms::Tensor grads[4] = {out[0], out[1], out[2], out[3]};
                  const core::SparseFlashMlaGrads g = common::sparse_flash_mla_grads(c, tnd, grads);
                  checked([&] {
                    cpu_kernels().sparse_flash_mla_backward(p, g, ThreadExecutor());
                    return 0;
                  });
                });
}

}  // namespace opmesh::ms_binding
