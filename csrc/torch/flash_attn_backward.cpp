// flash_attn_backward: the gradients of flash_attn with respect to q, k, v and sinks, as an
// operator of its own (schema, CPU kernel, shape function), so that flash_attn's autograd
// formula (autograd.cpp) is an ordinary graph node for AOTAutograd and torch.export.
#include "attention/flash_attn_backward.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "aten_executor.h"
#include "attention/metadata.h"
#include "core_calls.h"
#include "dtypes.h"
#include "flash_attn_args.h"
#include "flash_attn_calls.h"
#include "flash_attn_params.h"
#include "output_memory.h"
#include "torch_access.h"

namespace opmesh::binding {
namespace {

using Grads = Outputs4;

// The forward's checks, plus those of the saved output, its gradient and the log-sum-exp.
FlashAttnArgs check_backward_args(const FlashAttnBackwardCall& g) {
  TORCH_CHECK_VALUE(g.layout_kv != "PA_BBND",
                    "layout_kv: PA_BBND (paged keys and values) has no backward; train with "
                    "BSND, BNSD or TND keys and values");
  FlashAttnCall forward;
  forward.q = g.q;
  forward.k = g.k;
  forward.v = g.v;
  forward.metadata = g.metadata;
  ops::copy_attn_shared(g, forward);
  const FlashAttnArgs args = check_flash_attn_args(forward);
  for (const auto& [t, name] :
       {std::pair<const at::Tensor&, const char*>{g.dout, "dout"}, {g.out, "out"}}) {
    TORCH_CHECK_VALUE(t.device() == g.q.device(), name, ": expected a tensor on ", g.q.device(),
                      " like q, got ", t.device());
    TORCH_CHECK_TYPE(t.scalar_type() == g.q.scalar_type(), name, ": expected dtype ",
                     g.q.scalar_type(), " like q, got ", t.scalar_type());
  }
  TORCH_CHECK_VALUE(holds(g.dout.sym_sizes().equals(g.out.sym_sizes())), "dout: expected shape ",
                    g.out.sym_sizes(), " (the output's), got ", g.dout.sym_sizes());
  const Axes qa = args.qa;
  TORCH_CHECK_VALUE(g.out.dim() == qa.rank, "out: expected ", qa.rank, " dims, got ", g.out.dim());
  const c10::SymInt nq = g.q.sym_size(qa.n);
  std::vector<c10::SymInt> lse_shape;
  if (args.q_tnd) {
    lse_shape = {nq, g.q.sym_size(0)};
  } else {
    lse_shape = {g.q.sym_size(qa.b), nq, g.q.sym_size(qa.s)};
  }
  const std::vector<c10::SymInt> out_shape =
      args.q_tnd ? std::vector<c10::SymInt>{g.q.sym_size(0), nq, g.v.sym_size(args.ka.d)}
      : args.config.layout_out == attn::Layout::kBNSD
          ? std::vector<c10::SymInt>{g.q.sym_size(qa.b), nq, g.q.sym_size(qa.s),
                                     g.v.sym_size(args.ka.d)}
          : std::vector<c10::SymInt>{g.q.sym_size(qa.b), g.q.sym_size(qa.s), nq,
                                     g.v.sym_size(args.ka.d)};
  TORCH_CHECK_VALUE(holds(g.out.sym_sizes().equals(out_shape)), "out: expected shape ",
                    c10::SymIntArrayRef(out_shape), ", got ", g.out.sym_sizes());
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&g.lse, "lse"},
                                {g.dlse.has_value() ? &*g.dlse : nullptr, "dlse"}}) {
    if (t == nullptr) continue;
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, name, ": expected float32, got ",
                     t->scalar_type());
    TORCH_CHECK_VALUE(t->device() == g.q.device(), name, ": expected a tensor on ", g.q.device());
    TORCH_CHECK_VALUE(holds(t->sym_sizes().equals(lse_shape)), name, ": expected shape ",
                      c10::SymIntArrayRef(lse_shape), ", got ", t->sym_sizes());
  }
  return args;
}

Grads empty_grads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const std::optional<at::Tensor>& sinks, bool zero) {
  auto make = [&](const at::Tensor& t) {
    at::Tensor out = at::empty_symint(t.sym_sizes(), t.options());
    advise_huge_pages(out);
    return zero ? out.zero_() : out;
  };
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dsinks = sinks.has_value() ? (zero ? at::zeros_symint(sinks->sym_sizes(), f32)
                                                : at::empty_symint(sinks->sym_sizes(), f32))
                                        : at::empty({0}, f32);
  return {make(q), make(k), make(v), dsinks};
}

Grads flash_attn_backward_cpu(const FlashAttnBackwardCall& g) {
  const at::Tensor& q = g.q;
  const at::Tensor& k = g.k;
  const at::Tensor& v = g.v;
  const std::optional<at::Tensor>& sinks = g.sinks;
  TORCH_CHECK_VALUE(q.device().is_cpu(), "q: expected a CPU tensor, got ", q.device());
  const FlashAttnArgs args = check_backward_args(g);
  if (args.no_heads) return empty_grads(q, k, v, sinks, /*zero=*/true);
  attn::PlanConfig c = args.config;
  c.batch_size = args.batch.expect_int();
  const HostLengths host(g);
  const attn::LengthArrays& lengths = host.arrays;
  const calls::FlashAttnShapes shapes = common::flash_attn_shapes(q, k, c);
  const HostInts words = host_ints(g.metadata);
  const calls::PlanWords given{words.data(), words.tensor.defined() ? words.tensor.numel() : 0};
  const calls::PreparedBackward prepared = rethrow([&] {
    return calls::prepare_backward(c, shapes, lengths, concrete_or_none(g.max_seqlen_q),
                                   concrete_or_none(g.max_seqlen_kv), given);
  });
  c = prepared.config;
  const std::vector<attn::Sequence>& seqs = prepared.sequences;
  const std::optional<attn::metadata::Decoded>& decoded = prepared.decoded;

  Grads grads = empty_grads(q, k, v, sinks, /*zero=*/true);
  const auto& [dq, dk, dv, dsinks] = grads;
  // The statistics, sinks and slopes contiguous (float32 by the checks), as the core reads them.
  FlashAttnBackwardCall readable = g;
  readable.lse = g.lse.contiguous();
  if (g.dlse.has_value()) readable.dlse = g.dlse->contiguous();
  if (sinks.has_value()) readable.sinks = sinks->contiguous();
  if (g.alibi_slopes.has_value()) readable.alibi_slopes = g.alibi_slopes->contiguous();
  const at::Tensor outputs[4] = {dq, dk, dv, dsinks};
  const attn::FlashAttnBackwardParams p =
      common::flash_attn_backward_params(readable, c, args.q_tnd, outputs);
  rethrow([&] {
    cpu_kernels().flash_attn_backward(p, seqs, AtenExecutor(),
                                      decoded ? &decoded->backward : nullptr);
    return 0;
  });
  return grads;
}

Grads flash_attn_backward_meta(const FlashAttnBackwardCall& g) {
  check_backward_args(g);
  return empty_grads(g.q, g.k, g.v, g.sinks, /*zero=*/false);
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, CPU, m) { impl<FlashAttnBackwardCall, flash_attn_backward_cpu>(m); }
TORCH_LIBRARY_IMPL(opmesh, Meta, m) { impl<FlashAttnBackwardCall, flash_attn_backward_meta>(m); }

}  // namespace opmesh::binding
