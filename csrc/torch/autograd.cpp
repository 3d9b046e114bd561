// What autograd does with each operator, registered on the operators themselves, so the Python
// functions, torch.ops.opmesh.* and compiled graphs behave alike:
// - flash_attn's gradients come from opmesh::flash_attn_backward (flash_attn_backward.cpp), an
//   operator with its own schema and shape function, so compiled graphs (AOTAutograd) contain
//   it as an ordinary node. The forward always computes the log-sum-exp when a gradient may be
//   asked (the backward needs it) and returns it only when requested; the lse output is
//   differentiable too. Paged keys and values (PA_BBND) have no backward: the backward operator
//   refuses them when it runs.
// - dense_lightning_indexer_softmax_lse returns softmax statistics and lightning_indexer a top-k
//   selection with its scores, which are not differentiable: their outputs never require a
//   gradient (the sparse KL loss trains the indexer).
// - dense_lightning_indexer_grad_kl_loss and sparse_lightning_indexer_grad_kl_loss return a loss
//   and its gradients with respect to query_index, key_index and weights: the loss is
//   differentiable in those three (its backward scales the returned gradients by the loss's
//   gradient), the returned gradients are not (no second order), and the main attention's tensors
//   and the statistics, which the loss treats as a fixed target, refuse to require a gradient.
// - sparse_flash_attention's gradients come from opmesh::sparse_flash_attention_backward, as
//   flash_attn's do; its statistics outputs are not differentiable. Paged keys and values have
//   no backward (the backward operator refuses them).
// - sparse_flash_mla's gradients come from opmesh::sparse_flash_mla_backward; like flash_attn,
//   its forward computes the log-sum-exp whenever a gradient may be asked, and the returned lse
//   is differentiable.
// - kv_cache_write_ refuses grad-requiring arguments (kv_cache_cpu.cpp).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "op_call.h"

namespace opmesh::binding {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A call struct kept in an autograd context (its tensors are saved apart, with their versions).
template <class Call>
c10::IValue pack(const Call& call) {
  torch::jit::Stack values;
  push_call(values, call);
  return c10::ivalue::Tuple::create(std::move(values));
}

template <class Call>
Call unpack(const c10::IValue& packed) {
  return call_from_stack<Call>(packed.toTupleRef().elements());
}

// Call's operator below the autograd key.
template <class Call>
torch::jit::Stack call_below_autograd(const Call& call) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return call_op(call);
}

class FlashAttnFunction : public torch::autograd::Function<FlashAttnFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const std::optional<at::Tensor>& sinks,
                               const FlashAttnCall& call) {
    // The backward needs the log-sum-exp whether or not the caller asked for it.
    FlashAttnCall with_lse = call;
    with_lse.return_softmax_lse = true;
    auto [out, lse] = tensors_of<2>(call_below_autograd(with_lse));
    // Unused outputs' gradients stay undefined (materialised zeros would be plain tensors even
    // when the inputs are DTensors); backward handles them.
    ctx->set_materialize_grads(false);
    ctx->saved_data["has_sinks"] = sinks.has_value();
    ctx->saved_data["returns_lse"] = call.return_softmax_lse;
    // The backward's arguments besides the tensors saved below.
    FlashAttnBackwardCall backward;
    ops::copy_attn_shared(call, backward);
    backward.sinks.reset();
    backward.alibi_slopes.reset();
    ctx->saved_data["backward"] = pack(backward);
    ctx->saved_data["has_alibi"] = call.alibi_slopes.has_value();
    variable_list saved{q, k, v, out, lse};
    if (sinks.has_value()) saved.push_back(*sinks);
    if (call.alibi_slopes.has_value()) saved.push_back(*call.alibi_slopes);
    ctx->save_for_backward(saved);
    // new_empty keeps the tensor kind (a DTensor's empty lse stays a DTensor).
    at::Tensor lse_out = call.return_softmax_lse ? lse : lse.new_empty({0});
    if (!call.return_softmax_lse) ctx->mark_non_differentiable({lse_out});
    return {out, lse_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const bool has_sinks = ctx->saved_data["has_sinks"].toBool();
    const bool returns_lse = ctx->saved_data["returns_lse"].toBool();
    FlashAttnBackwardCall g = unpack<FlashAttnBackwardCall>(ctx->saved_data["backward"]);
    g.q = saved[0];
    g.k = saved[1];
    g.v = saved[2];
    g.out = saved[3];
    g.lse = saved[4];
    g.dout = grad_outputs[0].defined() ? grad_outputs[0] : at::zeros_like(g.out);
    if (returns_lse && grad_outputs[1].defined()) g.dlse = grad_outputs[1];
    if (has_sinks) g.sinks = saved[5];
    if (ctx->saved_data["has_alibi"].toBool()) g.alibi_slopes = saved[has_sinks ? 6 : 5];
    // metadata stays None: the backward plans for this process's threads.
    auto [dq, dk, dv, dsinks] = tensors_of<4>(call_op(g));
    return {dq, dk, dv, has_sinks ? dsinks : at::Tensor(), at::Tensor()};
  }
};

Outputs2 flash_attn_autograd(const FlashAttnCall& call) {
  // Inference (nothing requires a gradient): no autograd node, and no lse unless asked for.
  TORCH_CHECK_VALUE(
      !(at::GradMode::is_enabled() && call.alibi_slopes && call.alibi_slopes->requires_grad()),
      "alibi_slopes: flash_attn has no gradient for the ALiBi slopes (fixed per "
      "head); pass a tensor that does not require grad (e.g. slopes.detach())");
  const bool needs_grad = at::GradMode::is_enabled() &&
                          (call.q.requires_grad() || call.k.requires_grad() ||
                           call.v.requires_grad() || (call.sinks && call.sinks->requires_grad()));
  if (!needs_grad) return tensors_of<2>(call_below_autograd(call));
  TORCH_CHECK_VALUE(!call.k_scale.has_value(),
                    "k_scale: flash_attn has no backward through a quantized (",
                    call.k.scalar_type(),
                    ") cache; decode from it under torch.no_grad(), or train on a bf16 or float32 "
                    "cache");
  const variable_list out = FlashAttnFunction::apply(call.q, call.k, call.v, call.sinks, call);
  return {out[0], out[1]};
}

Outputs2 indexer_autograd(const IndexerCall& call) {
  return tensors_of<2>(call_below_autograd(call));  // outputs carry no gradient function
}

// sparse_flash_attention: gradients through opmesh::sparse_flash_attention_backward; the
// statistics outputs are not differentiable (the KL ops read them as a fixed target).
class SparseAttentionFunction : public torch::autograd::Function<SparseAttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const std::optional<at::Tensor>& query_rope,
                               const std::optional<at::Tensor>& key_rope,
                               const std::optional<at::Tensor>& sinks,
                               const SparseFlashAttentionCall& call) {
    SparseFlashAttentionCall with_stats = call;
    with_stats.return_softmax_lse = true;
    auto [out, smax, ssum] = tensors_of<3>(call_below_autograd(with_stats));
    ctx->set_materialize_grads(false);
    ctx->saved_data["has_rope"] = query_rope.has_value();
    ctx->saved_data["has_sinks"] = sinks.has_value();
    SparseFlashAttentionBackwardCall backward;
    ops::copy_sparse_attn_shared(call, backward);
    backward.query_rope.reset();
    backward.key_rope.reset();
    ctx->saved_data["backward"] = pack(backward);
    variable_list saved{q, k, v, call.sparse_indices, out, smax, ssum};
    if (query_rope) saved.insert(saved.end(), {*query_rope, *key_rope});
    if (sinks) saved.push_back(*sinks);
    ctx->save_for_backward(saved);
    if (!call.return_softmax_lse) {
      smax = smax.new_empty({0});
      ssum = ssum.new_empty({0});
    }
    ctx->mark_non_differentiable({smax, ssum});
    return {out, smax, ssum};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const bool has_rope = ctx->saved_data["has_rope"].toBool();
    const bool has_sinks = ctx->saved_data["has_sinks"].toBool();
    auto g = unpack<SparseFlashAttentionBackwardCall>(ctx->saved_data["backward"]);
    g.query = saved[0];
    g.key = saved[1];
    g.value = saved[2];
    g.sparse_indices = saved[3];
    g.attention_out = saved[4];
    g.softmax_max = saved[5];
    g.softmax_sum = saved[6];
    size_t next = 7;
    if (has_rope) {
      g.query_rope = saved[next++];
      g.key_rope = saved[next++];
    }
    if (has_sinks) g.sinks = saved[next++];
    g.dout = grad_outputs[0].defined() ? grad_outputs[0] : at::zeros_like(g.attention_out);
    const torch::jit::Stack grads = call_op(g);
    auto grad = [&](size_t i, bool present) {
      return present ? grads[i].toTensor() : at::Tensor();
    };
    return {grad(0, true),     grad(1, true),      grad(2, true), grad(3, has_rope),
            grad(4, has_rope), grad(5, has_sinks), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attention_autograd(
    const SparseFlashAttentionCall& call) {
  const auto wants_grad = [](const std::optional<at::Tensor>& t) {
    return t.has_value() && t->requires_grad();
  };
  const bool needs_grad =
      at::GradMode::is_enabled() &&
      (call.query.requires_grad() || call.key.requires_grad() || call.value.requires_grad() ||
       wants_grad(call.query_rope) || wants_grad(call.key_rope) || wants_grad(call.sinks));
  if (!needs_grad) return tensors_of<3>(call_below_autograd(call));
  TORCH_CHECK_VALUE(!call.key_scale.has_value(),
                    "key_scale: sparse_flash_attention has no backward through a quantized (",
                    call.key.scalar_type(),
                    ") key and value; decode from them under torch.no_grad(), or train on bf16 "
                    "or float32 ones");
  const variable_list out = SparseAttentionFunction::apply(
      call.query, call.key, call.value, call.query_rope, call.key_rope, call.sinks, call);
  return {out[0], out[1], out[2]};
}

// sparse_flash_mla: gradients for q, ori_kv, cmp_kv and sinks through
// opmesh::sparse_flash_mla_backward; softmax_lse, when returned, is differentiable too.
class SparseFlashMlaFunction : public torch::autograd::Function<SparseFlashMlaFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q,
                               const std::optional<at::Tensor>& ori_kv,
                               const std::optional<at::Tensor>& cmp_kv,
                               const std::optional<at::Tensor>& sinks,
                               const SparseFlashMlaCall& call) {
    SparseFlashMlaCall with_lse = call;
    with_lse.return_softmax_lse = true;
    auto [out, lse] = tensors_of<2>(call_below_autograd(with_lse));
    ctx->set_materialize_grads(false);
    SparseFlashMlaBackwardCall backward;
    ops::copy_mla_shared(call, backward);
    backward.ori_kv.reset();
    backward.cmp_kv.reset();
    backward.sinks.reset();
    ctx->saved_data["backward"] = pack(backward);
    ctx->saved_data["present"] =
        std::vector<bool>{ori_kv.has_value(), cmp_kv.has_value(), sinks.has_value()};
    ctx->saved_data["returns_lse"] = call.return_softmax_lse;
    variable_list saved{q, out, lse};
    for (const auto* t : {&ori_kv, &cmp_kv, &sinks}) saved.push_back(t->value_or(at::Tensor()));
    ctx->save_for_backward(saved);
    at::Tensor lse_out = call.return_softmax_lse ? lse : lse.new_zeros({});
    if (!call.return_softmax_lse) ctx->mark_non_differentiable({lse_out});
    return {out, lse_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const c10::List<bool> present = ctx->saved_data["present"].toBoolList();
    auto g = unpack<SparseFlashMlaBackwardCall>(ctx->saved_data["backward"]);
    g.q = saved[0];
    g.attention_out = saved[1];
    g.softmax_lse = saved[2];
    if (present[0]) g.ori_kv = saved[3];
    if (present[1]) g.cmp_kv = saved[4];
    if (present[2]) g.sinks = saved[5];
    g.dout = grad_outputs[0].defined() ? grad_outputs[0] : at::zeros_like(g.attention_out);
    if (ctx->saved_data["returns_lse"].toBool() && grad_outputs[1].defined()) {
      g.dlse = grad_outputs[1];
    }
    auto [dq, d_ori, d_cmp, dsinks] = tensors_of<4>(call_op(g));
    return {dq, present[0] ? d_ori : at::Tensor(), present[1] ? d_cmp : at::Tensor(),
            present[2] ? dsinks : at::Tensor(), at::Tensor()};
  }
};

Outputs2 sparse_flash_mla_autograd(const SparseFlashMlaCall& call) {
  const auto wants_grad = [](const std::optional<at::Tensor>& t) {
    return t.has_value() && t->requires_grad();
  };
  const bool needs_grad =
      at::GradMode::is_enabled() && (call.q.requires_grad() || wants_grad(call.ori_kv) ||
                                     wants_grad(call.cmp_kv) || wants_grad(call.sinks));
  if (!needs_grad) return tensors_of<2>(call_below_autograd(call));
  for (const auto& [scale, kv, name] :
       {std::tuple{&call.ori_kv_scale, &call.ori_kv, "ori_kv_scale"},
        std::tuple{&call.cmp_kv_scale, &call.cmp_kv, "cmp_kv_scale"}}) {
    TORCH_CHECK_VALUE(!scale->has_value(), name,
                      ": sparse_flash_mla has no backward through a quantized (",
                      (*kv)->scalar_type(),
                      ") kv; decode from it under torch.no_grad(), or train on bf16 or float32 "
                      "ones");
  }
  const variable_list out =
      SparseFlashMlaFunction::apply(call.q, call.ori_kv, call.cmp_kv, call.sinks, call);
  return {out[0], out[1]};
}

Outputs2 lightning_indexer_autograd(const LightningIndexerCall& call) {
  return tensors_of<2>(call_below_autograd(call));  // outputs carry no gradient function
}

// The KL losses (dense and sparse) return their gradients with the loss: backward scales them.
template <class Call>
class KlLossFunction : public torch::autograd::Function<KlLossFunction<Call>> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& qi, const at::Tensor& ki,
                               const at::Tensor& w, const Call& call) {
    auto [dqi, dki, dw, loss] = tensors_of<4>(call_below_autograd(call));
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
    out.push_back(at::Tensor());  // the call struct
    return out;
  }
};

template <class Call>
Outputs4 kl_loss_autograd(const Call& call) {
  if (!at::GradMode::is_enabled()) return tensors_of<4>(call_below_autograd(call));
  const at::Tensor* index_max = nullptr;
  const at::Tensor* index_sum = nullptr;
  if constexpr (std::is_same_v<Call, KlLossCall>) {
    index_max = &call.softmax_max_index;
    index_sum = &call.softmax_sum_index;
  }
  const std::pair<const at::Tensor*, const char*> fixed[] = {
      {&call.query, "query"},
      {&call.key, "key"},
      {call.query_rope ? &*call.query_rope : nullptr, "query_rope"},
      {call.key_rope ? &*call.key_rope : nullptr, "key_rope"},
      {&call.softmax_max, "softmax_max"},
      {&call.softmax_sum, "softmax_sum"},
      {index_max, "softmax_max_index"},
      {index_sum, "softmax_sum_index"},
  };
  for (const auto& [t, name] : fixed) {
    TORCH_CHECK_VALUE(t == nullptr || !t->requires_grad(), name,
                      ": requires a gradient, but the KL loss treats the main attention and the "
                      "statistics as a fixed target and has no gradient for them; pass ",
                      name, ".detach()");
  }
  if (!call.query_index.requires_grad() && !call.key_index.requires_grad() &&
      !call.weights.requires_grad()) {
    return tensors_of<4>(call_below_autograd(call));
  }
  const variable_list out =
      KlLossFunction<Call>::apply(call.query_index, call.key_index, call.weights, call);
  return {out[0], out[1], out[2], out[3]};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, Autograd, m) {
  impl<KlLossCall, kl_loss_autograd<KlLossCall>>(m);
  impl<SparseKlLossCall, kl_loss_autograd<SparseKlLossCall>>(m);
  impl<FlashAttnCall, flash_attn_autograd>(m);
  impl<IndexerCall, indexer_autograd>(m);
  impl<LightningIndexerCall, lightning_indexer_autograd>(m);
  impl<SparseFlashAttentionCall, sparse_attention_autograd>(m);
  impl<SparseFlashMlaCall, sparse_flash_mla_autograd>(m);
}

}  // namespace opmesh::binding
