// What autograd does with each operator, registered on the operators themselves, so the Python
// functions, torch.ops.opmesh.* and compiled graphs behave alike:
// - flash_attn has no backward yet. Outputs computed from inputs that require a gradient get a
//   gradient function whose backward calls opmesh::_no_gradient, an op that raises when it runs
//   (its shape function only allocates). Asking for a gradient fails loudly, eagerly and in
//   compiled graphs, while a compiled forward with grad-requiring inputs still traces and runs:
//   a gradient is never dropped silently.
// - dense_lightning_indexer_softmax_lse returns softmax statistics, which are not
//   differentiable: its outputs never require a gradient.
// - kv_cache_write_ refuses grad-requiring arguments (kv_cache_cpu.cpp).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace opmesh::binding {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// `grad` ties the op to the incoming gradient, so a compiled graph can only place it in the
// backward pass.
std::vector<at::Tensor> no_gradient_cpu(const at::Tensor& grad, at::TensorList like,
                                        c10::string_view op) {
  TORCH_CHECK(false, op,
              ": has no backward, so no gradient can be computed for its inputs; call it under "
              "torch.no_grad() or on detached tensors");
}

std::vector<at::Tensor> no_gradient_meta(const at::Tensor&, at::TensorList like, c10::string_view) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : like) out.push_back(at::empty_like(t));
  return out;
}

// Everything flash_attn takes besides q, k, v and sinks, carried through the autograd Function.
struct Rest {
  std::optional<at::Tensor> block_table, cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv,
      metadata;
  std::optional<double> softmax_scale;
  int64_t mask_mode, win_left, win_right;
  std::optional<c10::SymInt> max_seqlen_q, max_seqlen_kv;
  std::string layout_q, layout_kv, layout_out;
  bool return_softmax_lse;
};

using FlashAttnSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, std::optional<double>,
    int64_t, int64_t, int64_t, std::optional<c10::SymInt>, std::optional<c10::SymInt>,
    c10::string_view, c10::string_view, c10::string_view, bool);

class FlashAttnWithoutBackward : public torch::autograd::Function<FlashAttnWithoutBackward> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const std::optional<at::Tensor>& sinks,
                               const Rest& r) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("opmesh::flash_attn", "")
                               .typed<FlashAttnSig>();
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = op.call(q, k, v, r.block_table, r.cu_seqlens_q, r.cu_seqlens_kv, r.seqused_q,
                              r.seqused_kv, sinks, r.metadata, r.softmax_scale, r.mask_mode,
                              r.win_left, r.win_right, r.max_seqlen_q, r.max_seqlen_kv, r.layout_q,
                              r.layout_kv, r.layout_out, r.return_softmax_lse);
    ctx->saved_data["has_sinks"] = sinks.has_value();
    ctx->save_for_backward(sinks.has_value() ? variable_list{q, k, v, *sinks}
                                             : variable_list{q, k, v});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("opmesh::_no_gradient", "")
            .typed<std::vector<at::Tensor>(const at::Tensor&, at::TensorList, c10::string_view)>();
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& grad = grad_outputs[0].defined() ? grad_outputs[0] : grad_outputs[1];
    std::vector<at::Tensor> grads = op.call(grad, saved, "flash_attn");
    const bool has_sinks = ctx->saved_data["has_sinks"].toBool();
    return {grads[0], grads[1], grads[2], has_sinks ? grads[3] : at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> flash_attn_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_kv, const std::optional<at::Tensor>& seqused_q,
    const std::optional<at::Tensor>& seqused_kv, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& metadata, std::optional<double> softmax_scale,
    int64_t mask_mode, int64_t win_left, int64_t win_right, std::optional<c10::SymInt> max_seqlen_q,
    std::optional<c10::SymInt> max_seqlen_kv, c10::string_view layout_q, c10::string_view layout_kv,
    c10::string_view layout_out, bool return_softmax_lse) {
  const Rest rest{block_table,
                  cu_seqlens_q,
                  cu_seqlens_kv,
                  seqused_q,
                  seqused_kv,
                  metadata,
                  softmax_scale,
                  mask_mode,
                  win_left,
                  win_right,
                  std::move(max_seqlen_q),
                  std::move(max_seqlen_kv),
                  std::string(layout_q),
                  std::string(layout_kv),
                  std::string(layout_out),
                  return_softmax_lse};
  const variable_list out = FlashAttnWithoutBackward::apply(q, k, v, sinks, rest);
  return {out[0], out[1]};
}

using IndexerSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&,
                                                      const std::optional<at::Tensor>&,
                                                      const std::optional<at::Tensor>&,
                                                      c10::string_view, int64_t);

std::tuple<at::Tensor, at::Tensor> indexer_autograd(
    const at::Tensor& query_index, const at::Tensor& key_index, const at::Tensor& weights,
    const std::optional<at::Tensor>& actual_seq_qlen,
    const std::optional<at::Tensor>& actual_seq_klen, c10::string_view layout,
    int64_t sparse_mode) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("opmesh::dense_lightning_indexer_softmax_lse", "")
                             .typed<IndexerSig>();
  at::AutoDispatchBelowADInplaceOrView guard;  // outputs carry no gradient function
  return op.call(query_index, key_index, weights, actual_seq_qlen, actual_seq_klen, layout,
                 sparse_mode);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(opmesh, m) {
  m.def("_no_gradient(Tensor grad, Tensor[] like, str op) -> Tensor[]");
}
TORCH_LIBRARY_IMPL(opmesh, CPU, m) { m.impl("_no_gradient", &no_gradient_cpu); }
TORCH_LIBRARY_IMPL(opmesh, Meta, m) { m.impl("_no_gradient", &no_gradient_meta); }
TORCH_LIBRARY_IMPL(opmesh, Autograd, m) {
  m.impl("flash_attn", &flash_attn_autograd);
  m.impl("dense_lightning_indexer_softmax_lse", &indexer_autograd);
}

}  // namespace opmesh::binding
