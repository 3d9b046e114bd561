// What autograd does with each operator, registered on the operators themselves, so the Python
// functions, torch.ops.opmesh.* and compiled graphs behave alike:
// - flash_attn's gradients come from opmesh::flash_attn_backward (flash_attn_backward.cpp), an
//   operator with its own schema and shape function, so compiled graphs (AOTAutograd) contain
//   it as an ordinary node. The forward always computes the log-sum-exp when a gradient may be
//   asked (the backward needs it) and returns it only when requested; the lse output is
//   differentiable too. Paged keys and values (PA_BBND) have no backward: the backward operator
//   refuses them when it runs.
// - dense_lightning_indexer_softmax_lse returns softmax statistics, which are not
//   differentiable: its outputs never require a gradient.
// - dense_lightning_indexer_grad_kl_loss returns a loss and its gradients with respect to
//   query_index, key_index and weights: the loss is differentiable in those three (its backward
//   scales the returned gradients by the loss's gradient), the returned gradients are not (no
//   second order), and the main attention's tensors and the statistics, which the loss treats
//   as a fixed target, refuse to require a gradient.
// - kv_cache_write_ refuses grad-requiring arguments (kv_cache_cpu.cpp).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "op_signatures.h"

namespace opmesh::binding {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

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

// What the backward needs of Rest, kept in the autograd context as IValues.
void save_rest(AutogradContext* ctx, const Rest& r) {
  auto& d = ctx->saved_data;
  d["cu_seqlens_q"] = r.cu_seqlens_q;
  d["cu_seqlens_kv"] = r.cu_seqlens_kv;
  d["seqused_q"] = r.seqused_q;
  d["seqused_kv"] = r.seqused_kv;
  d["softmax_scale"] = r.softmax_scale;
  d["mask_mode"] = r.mask_mode;
  d["win_left"] = r.win_left;
  d["win_right"] = r.win_right;
  d["max_seqlen_q"] = r.max_seqlen_q.has_value() ? c10::IValue(*r.max_seqlen_q) : c10::IValue();
  d["max_seqlen_kv"] = r.max_seqlen_kv.has_value() ? c10::IValue(*r.max_seqlen_kv) : c10::IValue();
  d["layout_q"] = r.layout_q;
  d["layout_kv"] = r.layout_kv;
  d["layout_out"] = r.layout_out;
}

Rest load_rest(AutogradContext* ctx) {
  auto& d = ctx->saved_data;
  auto tensor = [&](const char* key) -> std::optional<at::Tensor> {
    const c10::IValue& v = d[key];
    return v.isNone() ? std::nullopt : std::optional<at::Tensor>(v.toTensor());
  };
  auto symint = [&](const char* key) -> std::optional<c10::SymInt> {
    const c10::IValue& v = d[key];
    return v.isNone() ? std::nullopt : std::optional<c10::SymInt>(v.toSymInt());
  };
  Rest r;
  r.cu_seqlens_q = tensor("cu_seqlens_q");
  r.cu_seqlens_kv = tensor("cu_seqlens_kv");
  r.seqused_q = tensor("seqused_q");
  r.seqused_kv = tensor("seqused_kv");
  r.softmax_scale = d["softmax_scale"].isNone()
                        ? std::nullopt
                        : std::optional<double>(d["softmax_scale"].toDouble());
  r.mask_mode = d["mask_mode"].toInt();
  r.win_left = d["win_left"].toInt();
  r.win_right = d["win_right"].toInt();
  r.max_seqlen_q = symint("max_seqlen_q");
  r.max_seqlen_kv = symint("max_seqlen_kv");
  r.layout_q = d["layout_q"].toStringRef();
  r.layout_kv = d["layout_kv"].toStringRef();
  r.layout_out = d["layout_out"].toStringRef();
  return r;
}

// flash_attn itself, below the autograd key.
std::tuple<at::Tensor, at::Tensor> call_below_autograd(const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& v,
                                                       const std::optional<at::Tensor>& sinks,
                                                       const Rest& r, bool return_softmax_lse) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("opmesh::flash_attn", "")
                             .typed<FlashAttnSig>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(q, k, v, r.block_table, r.cu_seqlens_q, r.cu_seqlens_kv, r.seqused_q, r.seqused_kv,
                 sinks, r.metadata, r.softmax_scale, r.mask_mode, r.win_left, r.win_right,
                 r.max_seqlen_q, r.max_seqlen_kv, r.layout_q, r.layout_kv, r.layout_out,
                 return_softmax_lse);
}

class FlashAttnFunction : public torch::autograd::Function<FlashAttnFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const std::optional<at::Tensor>& sinks,
                               const Rest& r) {
    // The backward needs the log-sum-exp whether or not the caller asked for it.
    auto [out, lse] = call_below_autograd(q, k, v, sinks, r, /*return_softmax_lse=*/true);
    // Unused outputs' gradients stay undefined (materialised zeros would be plain tensors even
    // when the inputs are DTensors); backward handles them.
    ctx->set_materialize_grads(false);
    ctx->saved_data["has_sinks"] = sinks.has_value();
    ctx->saved_data["returns_lse"] = r.return_softmax_lse;
    save_rest(ctx, r);
    variable_list saved{q, k, v, out, lse};
    if (sinks.has_value()) saved.push_back(*sinks);
    ctx->save_for_backward(saved);
    // new_empty keeps the tensor kind (a DTensor's empty lse stays a DTensor).
    at::Tensor lse_out = r.return_softmax_lse ? lse : lse.new_empty({0});
    if (!r.return_softmax_lse) ctx->mark_non_differentiable({lse_out});
    return {out, lse_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("opmesh::flash_attn_backward", "")
                               .typed<BackwardSig>();
    const variable_list saved = ctx->get_saved_variables();
    const bool has_sinks = ctx->saved_data["has_sinks"].toBool();
    const bool returns_lse = ctx->saved_data["returns_lse"].toBool();
    const Rest r = load_rest(ctx);
    const at::Tensor& out = saved[3];
    const at::Tensor& lse = saved[4];
    const at::Tensor dout = grad_outputs[0].defined() ? grad_outputs[0] : at::zeros_like(out);
    std::optional<at::Tensor> dlse;
    if (returns_lse && grad_outputs[1].defined()) dlse = grad_outputs[1];
    std::optional<at::Tensor> sinks;
    if (has_sinks) sinks = saved[5];
    auto [dq, dk, dv, dsinks] =
        op.call(dout, saved[0], saved[1], saved[2], out, lse, dlse, r.cu_seqlens_q, r.cu_seqlens_kv,
                r.seqused_q, r.seqused_kv, sinks, r.softmax_scale, r.mask_mode, r.win_left,
                r.win_right, r.max_seqlen_q, r.max_seqlen_kv, r.layout_q, r.layout_kv, r.layout_out,
                /*metadata=*/std::nullopt);  // planned by the kernel for this process's threads
    return {dq, dk, dv, has_sinks ? dsinks : at::Tensor(), at::Tensor()};
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
  // Inference (nothing requires a gradient): no autograd node, and no lse unless asked for.
  const bool needs_grad =
      at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                                     (sinks && sinks->requires_grad()));
  if (!needs_grad) return call_below_autograd(q, k, v, sinks, rest, return_softmax_lse);
  const variable_list out = FlashAttnFunction::apply(q, k, v, sinks, rest);
  return {out[0], out[1]};
}

std::tuple<at::Tensor, at::Tensor> indexer_autograd(
    const at::Tensor& query_index, const at::Tensor& key_index, const at::Tensor& weights,
    const std::optional<at::Tensor>& actual_seq_qlen,
    const std::optional<at::Tensor>& actual_seq_klen, c10::string_view layout, int64_t sparse_mode,
    int64_t pre_tokens, int64_t next_tokens) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("opmesh::dense_lightning_indexer_softmax_lse", "")
                             .typed<IndexerSig>();
  at::AutoDispatchBelowADInplaceOrView guard;  // outputs carry no gradient function
  return op.call(query_index, key_index, weights, actual_seq_qlen, actual_seq_klen, layout,
                 sparse_mode, pre_tokens, next_tokens);
}

// Everything dense_lightning_indexer_grad_kl_loss takes besides query_index, key_index, weights.
struct KlRest {
  at::Tensor query, key, softmax_max, softmax_sum, softmax_max_index, softmax_sum_index;
  double scale_value;
  std::optional<at::Tensor> query_rope, key_rope, actual_seq_qlen, actual_seq_klen;
  std::string layout;
  int64_t sparse_mode, pre_tokens, next_tokens;
};

KlResult kl_below_autograd(const at::Tensor& qi, const at::Tensor& ki, const at::Tensor& w,
                           const KlRest& r) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("opmesh::dense_lightning_indexer_grad_kl_loss", "")
                             .typed<KlSig>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(r.query, r.key, qi, ki, w, r.softmax_max, r.softmax_sum, r.softmax_max_index,
                 r.softmax_sum_index, r.scale_value, r.query_rope, r.key_rope, r.actual_seq_qlen,
                 r.actual_seq_klen, r.layout, r.sparse_mode, r.pre_tokens, r.next_tokens);
}

class KlLossFunction : public torch::autograd::Function<KlLossFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& qi, const at::Tensor& ki,
                               const at::Tensor& w, const KlRest& r) {
    auto [dqi, dki, dw, loss] = kl_below_autograd(qi, ki, w, r);
    ctx->save_for_backward({dqi, dki, dw});
    ctx->mark_non_differentiable({dqi, dki, dw});
    return {dqi, dki, dw, loss};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& g = grad_outputs[3];
    variable_list out;
    for (const at::Tensor& d : saved) {
      out.push_back(g.defined() ? (d.to(at::kFloat) * g).to(d.scalar_type()) : at::zeros_like(d));
    }
    out.push_back(at::Tensor());  // KlRest
    return out;
  }
};

KlResult kl_loss_autograd(const at::Tensor& query, const at::Tensor& key,
                          const at::Tensor& query_index, const at::Tensor& key_index,
                          const at::Tensor& weights, const at::Tensor& softmax_max,
                          const at::Tensor& softmax_sum, const at::Tensor& softmax_max_index,
                          const at::Tensor& softmax_sum_index, double scale_value,
                          const std::optional<at::Tensor>& query_rope,
                          const std::optional<at::Tensor>& key_rope,
                          const std::optional<at::Tensor>& actual_seq_qlen,
                          const std::optional<at::Tensor>& actual_seq_klen, c10::string_view layout,
                          int64_t sparse_mode, int64_t pre_tokens, int64_t next_tokens) {
  const KlRest rest{
      query,       key,        softmax_max, softmax_sum,     softmax_max_index, softmax_sum_index,
      scale_value, query_rope, key_rope,    actual_seq_qlen, actual_seq_klen,   std::string(layout),
      sparse_mode, pre_tokens, next_tokens};
  if (!at::GradMode::is_enabled()) return kl_below_autograd(query_index, key_index, weights, rest);
  const std::pair<const at::Tensor*, const char*> fixed[] = {
      {&query, "query"},
      {&key, "key"},
      {query_rope ? &*query_rope : nullptr, "query_rope"},
      {key_rope ? &*key_rope : nullptr, "key_rope"},
      {&softmax_max, "softmax_max"},
      {&softmax_sum, "softmax_sum"},
      {&softmax_max_index, "softmax_max_index"},
      {&softmax_sum_index, "softmax_sum_index"},
  };
  for (const auto& [t, name] : fixed) {
    TORCH_CHECK_VALUE(t == nullptr || !t->requires_grad(), name,
                      ": requires a gradient, but the KL loss treats the main attention and the "
                      "statistics as a fixed target and has no gradient for them; pass ",
                      name, ".detach()");
  }
  if (!query_index.requires_grad() && !key_index.requires_grad() && !weights.requires_grad()) {
    return kl_below_autograd(query_index, key_index, weights, rest);
  }
  const variable_list out = KlLossFunction::apply(query_index, key_index, weights, rest);
  return {out[0], out[1], out[2], out[3]};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, Autograd, m) {
  m.impl("dense_lightning_indexer_grad_kl_loss", &kl_loss_autograd);
  m.impl("flash_attn", &flash_attn_autograd);
  m.impl("dense_lightning_indexer_softmax_lse", &indexer_autograd);
}

}  // namespace opmesh::binding
