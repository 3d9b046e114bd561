// merge_attn_states: two partial attention results over disjoint key sets, combined into the
// result over their union by log-sum-exp weights (ring context parallel, split-KV decode).
//
//   lse = log(exp(lse_a) + exp(lse_b))
//   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b
//
// flash_attn marks a row that saw no key with lse +inf and output 0; such a partial counts as
// empty here (no mass), and a row empty in both stays (0, +inf). Written with ATen operations as
// a CompositeImplicitAutograd kernel: autograd, the shape function and every backend follow.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>

#include "op_call.h"

namespace opmesh::binding {
namespace {

// lse [B, N, S] (BSND, BNSD) or [N, T] (TND) as a broadcastable weight for out.
at::Tensor as_out_weight(const at::Tensor& w, c10::string_view layout) {
  if (layout == "BSND") return w.transpose(1, 2).unsqueeze(-1);  // [B, S, N, 1]
  if (layout == "BNSD") return w.unsqueeze(-1);                  // [B, N, S, 1]
  return w.transpose(0, 1).unsqueeze(-1);                        // [T, N, 1]
}

void check(const MergeAttnStatesCall& a) {
  TORCH_CHECK_VALUE(a.layout == "BSND" || a.layout == "BNSD" || a.layout == "TND",
                    "layout: expected 'BSND', 'BNSD' or 'TND', got '", a.layout, "'");
  const int64_t rank = a.layout == "TND" ? 3 : 4;
  TORCH_CHECK_VALUE(a.out_a.dim() == rank, "out_a: expected a ", rank, "-D ", a.layout,
                    " tensor, got shape ", a.out_a.sym_sizes());
  TORCH_CHECK_VALUE(a.out_b.sym_sizes().equals(a.out_a.sym_sizes()), "out_b: expected shape ",
                    a.out_a.sym_sizes(), " like out_a, got ", a.out_b.sym_sizes());
  TORCH_CHECK_TYPE(a.out_b.scalar_type() == a.out_a.scalar_type(), "out_b: expected dtype ",
                   a.out_a.scalar_type(), " like out_a, got ", a.out_b.scalar_type());
  TORCH_CHECK_TYPE(at::isFloatingType(a.out_a.scalar_type()),
                   "out_a: expected a floating dtype, got ", a.out_a.scalar_type());
  std::vector<c10::SymInt> lse_shape;
  if (a.layout == "BSND") {
    lse_shape = {a.out_a.sym_size(0), a.out_a.sym_size(2), a.out_a.sym_size(1)};
  } else if (a.layout == "BNSD") {
    lse_shape = {a.out_a.sym_size(0), a.out_a.sym_size(1), a.out_a.sym_size(2)};
  } else {
    lse_shape = {a.out_a.sym_size(1), a.out_a.sym_size(0)};
  }
  for (const auto& [t, name] :
       {std::pair<const at::Tensor&, const char*>{a.lse_a, "lse_a"}, {a.lse_b, "lse_b"}}) {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, ": expected float32, got ",
                     t.scalar_type());
    TORCH_CHECK_VALUE(t.sym_sizes().equals(lse_shape), name, ": expected shape ",
                      c10::SymIntArrayRef(lse_shape), " (the lse of out_a's rows), got ",
                      t.sym_sizes());
  }
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{a.lse_a, "lse_a"},
                                {a.out_b, "out_b"},
                                {a.lse_b, "lse_b"}}) {
    TORCH_CHECK_VALUE(t.device() == a.out_a.device(), name, ": expected a tensor on ",
                      a.out_a.device(), " like out_a, got ", t.device());
  }
}

Outputs2 merge_attn_states(const MergeAttnStatesCall& c) {
  check(c);
  constexpr double kInf = std::numeric_limits<double>::infinity();
  // +inf (flash_attn's empty row) -> -inf (no mass).
  const at::Tensor a = at::where(c.lse_a == kInf, -kInf, c.lse_a);
  const at::Tensor b = at::where(c.lse_b == kInf, -kInf, c.lse_b);
  const at::Tensor m = at::maximum(a, b);
  const at::Tensor finite_m = at::where(m == -kInf, at::zeros_like(m), m);
  const at::Tensor ea = at::exp(a - finite_m);
  const at::Tensor eb = at::exp(b - finite_m);
  const at::Tensor sum = ea + eb;
  const at::Tensor has_mass = sum > 0;
  const at::Tensor safe_sum = at::where(has_mass, sum, at::ones_like(sum));
  const at::Tensor lse = at::where(has_mass, finite_m + at::log(safe_sum), kInf);
  const at::Tensor wa = as_out_weight(ea / safe_sum, c.layout);
  const at::Tensor wb = as_out_weight(eb / safe_sum, c.layout);
  const at::Tensor out =
      (wa * c.out_a.to(at::kFloat) + wb * c.out_b.to(at::kFloat)).to(c.out_a.scalar_type());
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, CompositeImplicitAutograd, m) {
  impl<MergeAttnStatesCall, merge_attn_states>(m);
}

}  // namespace opmesh::binding
