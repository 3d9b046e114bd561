// Shape function of flash_attn for fake tensors and torch.compile. Sizes stay symbolic, so dynamic
// shapes need no recompilation. flash_attn_metadata's fake lives in opmesh/_fake.py: with no
// tensor argument at all there is no device for a Meta kernel to follow, and the plan is a CPU
// tensor whatever the inputs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "flash_attn_args.h"

namespace opmesh::binding {
namespace {

std::tuple<at::Tensor, at::Tensor> flash_attn_meta(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>&, std::optional<double>, int64_t, int64_t, int64_t,
    std::optional<int64_t>, std::optional<int64_t>, c10::string_view layout_q,
    c10::string_view layout_kv, c10::string_view layout_out, bool return_softmax_lse) {
  check_devices(q, k, v, block_table, sinks);
  const attn::Layout lq = parse_layout(layout_q, "layout_q");
  const attn::Layout lkv = parse_layout(layout_kv, "layout_kv");
  const attn::Layout lo = parse_layout(layout_out, "layout_out");
  TORCH_CHECK_VALUE(lq != attn::Layout::kPagedBBND,
                    "layout_q: expected 'BSND', 'BNSD' or 'TND', got 'PA_BBND'");
  check_rank(q, lq, "q");
  check_rank(k, lkv, "k");
  check_rank(v, lkv, "v");
  const Axes qa = axes_of(lq);
  const Axes ka = axes_of(lkv);
  const c10::SymInt nq = q.sym_size(qa.n);
  const c10::SymInt dv = v.sym_size(ka.d);
  const auto lse_options = q.options().dtype(at::kFloat);
  if (lq == attn::Layout::kTND) {
    const c10::SymInt t = q.sym_size(0);
    at::Tensor out = at::empty_symint({t, nq, dv}, q.options());
    at::Tensor lse =
        return_softmax_lse ? at::empty_symint({nq, t}, lse_options) : at::empty({0}, lse_options);
    return {out, lse};
  }
  const c10::SymInt b = q.sym_size(qa.b);
  const c10::SymInt s = q.sym_size(qa.s);
  at::Tensor out = lo == attn::Layout::kBNSD ? at::empty_symint({b, nq, s, dv}, q.options())
                                             : at::empty_symint({b, s, nq, dv}, q.options());
  at::Tensor lse =
      return_softmax_lse ? at::empty_symint({b, nq, s}, lse_options) : at::empty({0}, lse_options);
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, Meta, m) { m.impl("flash_attn", &flash_attn_meta); }

}  // namespace opmesh::binding
