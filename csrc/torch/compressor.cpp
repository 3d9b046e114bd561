// compressor and compressor_backward: checks shared by the CPU and Meta kernels, the CPU kernels
// (the core on PyTorch's pool), the shape functions, and what autograd does: cmp_kv is
// differentiable in x, wkv, wgate and ape through compressor_backward; state_cache is written in
// place (its version counter advances, as PyTorch's own in-place ops do) and has no gradient.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/grad_mode.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <utility>

#include "aten_executor.h"
#include "checks.h"
#include "compressor_params.h"
#include "dtypes.h"
#include "op_call.h"
#include "output_memory.h"
#include "torch_access.h"

namespace opmesh::binding {
namespace {

using OptTensor = std::optional<at::Tensor>;

void check_ints(const OptTensor& t, const char* name, const at::Tensor& x, int64_t rank,
                const std::optional<c10::SymInt>& rows) {
  if (!t) return;
  TORCH_CHECK_VALUE(t->device() == x.device(), name, ": expected a tensor on ", x.device(),
                    " like x, got ", t->device());
  TORCH_CHECK_TYPE(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong, name,
                   ": expected int32 or int64, got ", t->scalar_type());
  TORCH_CHECK_VALUE(t->dim() == rank, name, ": expected a ", rank, "-D tensor, got shape ",
                    t->sym_sizes());
  if (rows) {
    TORCH_CHECK_VALUE(holds(t->sym_size(0).sym_eq(*rows)), name, ": expected ", *rows,
                      " rows, got shape ", t->sym_sizes());
  }
}

void check_float(const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK_VALUE(t.device() == x.device(), name, ": expected a tensor on ", x.device(),
                    " like x, got ", t.device());
  to_core_dtype(t.scalar_type(), name);
}

// projections' shape: x's, with 2 * coff * D values a token.
std::vector<c10::SymInt> projections_shape(const at::Tensor& x, const c10::SymInt& width) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = width * 2;
  return shape;
}

void check_projections(const at::Tensor& t, const at::Tensor& x, const c10::SymInt& width) {
  TORCH_CHECK_VALUE(t.device() == x.device(), "projections: expected a tensor on ", x.device(),
                    " like x, got ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "projections: expected float32, got ",
                   t.scalar_type());
  const std::vector<c10::SymInt> shape = projections_shape(x, width);
  TORCH_CHECK_VALUE(t.sym_sizes().equals(shape), "projections: expected shape ",
                    c10::SymIntArrayRef(shape), " (x's tokens, 2 * coff * D values each), got ",
                    t.sym_sizes());
  TORCH_CHECK_VALUE(holds(t.sym_stride(-1).sym_eq(1)),
                    "projections: its last dimension must be contiguous");
}

// Sizes of a checked call: batch and whether x is [T, H].
struct CompressorArgs {
  c10::SymInt batch;
  bool packed = false;
};

// The checks every kernel and the shape function share (values are the core's).
template <class Call>
CompressorArgs check_compressor_args(const Call& c) {
  const at::Tensor& x = c.x;
  TORCH_CHECK_VALUE(x.dim() == 2 || x.dim() == 3, "x: expected [B, S, H] or [T, H], got shape ",
                    x.sym_sizes());
  to_core_dtype(x.scalar_type(), "x");
  TORCH_CHECK_VALUE(c.coff == 1 || c.coff == 2,
                    "coff: expected 1 or 2 (two overlapping series), got ", c.coff);
  TORCH_CHECK_VALUE(c.cmp_ratio >= 1, "cmp_ratio: expected a positive ratio, got ", c.cmp_ratio);
  for (const auto& [t, name] :
       {std::pair<const at::Tensor&, const char*>{c.wkv, "wkv"}, {c.wgate, "wgate"}}) {
    check_float(t, name, x);
    TORCH_CHECK_TYPE(t.scalar_type() == x.scalar_type(), name, ": expected dtype ", x.scalar_type(),
                     " like x, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 2 && holds(t.sym_size(1).sym_eq(x.sym_size(-1))), name,
                      ": expected [coff * D, H] with H = ", x.sym_size(-1),
                      " (x's last dim), got shape ", t.sym_sizes());
  }
  TORCH_CHECK_VALUE(c.wgate.sym_sizes().equals(c.wkv.sym_sizes()), "wgate: expected shape ",
                    c.wkv.sym_sizes(), " like wkv, got ", c.wgate.sym_sizes());
  TORCH_CHECK_VALUE(holds((c.wkv.sym_size(0) % c.coff).sym_eq(0)),
                    "wkv: expected [coff * D, H] rows with coff = ", c.coff, ", got shape ",
                    c.wkv.sym_sizes());
  check_float(c.ape, "ape", x);
  const c10::SymInt& width = c.wkv.sym_size(0);
  TORCH_CHECK_VALUE(c.ape.dim() == 2 && holds(c.ape.sym_size(0).sym_eq(c.cmp_ratio)) &&
                        holds(c.ape.sym_size(1).sym_eq(width)),
                    "ape: expected [cmp_ratio, coff * D] = [", c.cmp_ratio, ", ", width,
                    "], got shape ", c.ape.sym_sizes());
  CompressorArgs a;
  a.packed = x.dim() == 2;
  if (a.packed) {
    TORCH_CHECK_VALUE(c.cu_seqlens.has_value(), "cu_seqlens: required when x is [T, H]");
    check_ints(c.cu_seqlens, "cu_seqlens", x, 1, std::nullopt);
    a.batch = c.cu_seqlens->sym_size(0) - 1;
    TORCH_CHECK_VALUE(holds(a.batch.sym_ge(0)), "cu_seqlens: expected B + 1 offsets, got shape ",
                      c.cu_seqlens->sym_sizes());
  } else {
    TORCH_CHECK_VALUE(!c.cu_seqlens.has_value(),
                      "cu_seqlens: only for x [T, H]; x [B, S, H] has S tokens per sequence");
    a.batch = x.sym_size(0);
  }
  check_ints(c.seqused, "seqused", x, 1, a.batch);
  check_ints(c.start_pos, "start_pos", x, 1, a.batch);
  if constexpr (requires { c.state_cache; }) {
    TORCH_CHECK_VALUE(c.cache_mode == 1 || c.cache_mode == 2,
                      "cache_mode: expected 1 (continuous) or 2 (ring buffer), got ", c.cache_mode);
    const at::Tensor& s = c.state_cache;
    TORCH_CHECK_VALUE(s.device() == x.device(), "state_cache: expected a tensor on ", x.device(),
                      " like x, got ", s.device());
    TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, "state_cache: expected float32, got ",
                     s.scalar_type());
    TORCH_CHECK_VALUE(s.dim() == 3 && holds(s.sym_size(2).sym_eq(width * 2)),
                      "state_cache: expected [block_num, block_size, 2 * coff * D] = [., ., ",
                      width * 2, "], got shape ", s.sym_sizes());
    TORCH_CHECK_VALUE(holds(s.sym_stride(2).sym_eq(1)),
                      "state_cache: its last dimension must be contiguous");
    check_ints(c.state_block_table, "state_block_table", x, c.cache_mode == 2 ? 1 : 2, a.batch);
  }
  if (c.projections) check_projections(*c.projections, x, width);
  return a;
}

// cmp_kv: [B, ceil(S / r), D], or [min(T, T // r + B), D] for x [T, H].
template <class Call>
std::vector<c10::SymInt> cmp_kv_shape(const Call& c, const CompressorArgs& a) {
  const c10::SymInt d = c.wkv.sym_size(0) / c.coff;
  if (!a.packed) {
    return {c.x.sym_size(0), (c.x.sym_size(1) + c.cmp_ratio - 1) / c.cmp_ratio, d};
  }
  const c10::SymInt& t = c.x.sym_size(0);
  return {t.min(t / c.cmp_ratio + a.batch), d};
}

// The core's params of a checked call.
template <class Call>
core::CompressorParams params_of(const Call& c, const common::CompressorHost& host,
                                 const at::Tensor& cmp_kv) {
  core::CompressorParams p = rethrow([&] { return common::compressor_params(c, host); });
  common::point_compressor(p, c, cmp_kv);
  return p;
}

// The state cache and projections are written: no input may share their memory (as PyTorch's
// in-place ops), nor may they share each other's.
void check_no_overlap(const CompressorCall& c) {
  const std::pair<const at::Tensor&, const char*> inputs[] = {{c.x, "x"},
                                                              {c.wkv, "wkv"},
                                                              {c.wgate, "wgate"},
                                                              {c.ape, "ape"},
                                                              {c.state_cache, "state_cache"}};
  const auto check = [&](const at::Tensor& written, const char* written_name, size_t count) {
    if (written.numel() == 0) return;
    for (size_t i = 0; i < count; ++i) {
      const auto& [t, name] = inputs[i];
      if (t.numel() == 0) continue;
      const at::MemOverlapStatus o = at::get_overlap_status(t, written);
      TORCH_CHECK_VALUE(o != at::MemOverlapStatus::Full && o != at::MemOverlapStatus::Partial, name,
                        ": shares memory with ", written_name,
                        ", which the call writes; pass a .clone()");
    }
  };
  check(c.state_cache, "state_cache", 4);
  if (c.projections) check(*c.projections, "projections", 5);
}

at::Tensor compressor_cpu(const CompressorCall& c) {
  TORCH_CHECK_VALUE(c.x.device().is_cpu(), "x: expected a CPU tensor, got ", c.x.device());
  const CompressorArgs a = check_compressor_args(c);
  check_no_overlap(c);
  at::Tensor out = at::empty_symint(cmp_kv_shape(c, a), c.x.options());
  advise_huge_pages(out);
  const common::CompressorHost host = common::compressor_host(c);
  const core::CompressorParams p = params_of(c, host, out);
  rethrow([&] { cpu_kernels().compressor(p, AtenExecutor()); });
  return out;
}

at::Tensor compressor_meta(const CompressorCall& c) {
  return at::empty_symint(cmp_kv_shape(c, check_compressor_args(c)), c.x.options());
}

Outputs4 backward_outputs(const CompressorBackwardCall& c) {
  return {advise_huge_pages(at::empty_symint(c.x.sym_sizes(), c.x.options())),
          at::empty_symint(c.wkv.sym_sizes(), c.wkv.options()),
          at::empty_symint(c.wgate.sym_sizes(), c.wgate.options()),
          at::empty_symint(c.ape.sym_sizes(), c.ape.options())};
}

template <class Call>
void check_grad_cmp_kv(const Call& c, const CompressorArgs& a) {
  const std::vector<c10::SymInt> shape = cmp_kv_shape(c, a);
  TORCH_CHECK_VALUE(c.grad_cmp_kv.sym_sizes().equals(shape), "grad_cmp_kv: expected shape ",
                    c10::SymIntArrayRef(shape), " (cmp_kv's), got ", c.grad_cmp_kv.sym_sizes());
  check_float(c.grad_cmp_kv, "grad_cmp_kv", c.x);
}

Outputs4 compressor_backward_cpu(const CompressorBackwardCall& call) {
  TORCH_CHECK_VALUE(call.x.device().is_cpu(), "x: expected a CPU tensor, got ", call.x.device());
  const CompressorArgs a = check_compressor_args(call);
  check_grad_cmp_kv(call, a);
  CompressorBackwardCall c = call;
  c.grad_cmp_kv = call.grad_cmp_kv.to(call.x.scalar_type());
  auto [dx, dwkv, dwgate, dape] = backward_outputs(c);
  const common::CompressorHost host = common::compressor_host(c);
  const core::CompressorParams p = params_of(c, host, c.grad_cmp_kv);
  const core::CompressorGrads g =
      common::compressor_grads(p, c.grad_cmp_kv, dx, dwkv, dwgate, dape);
  rethrow([&] { cpu_kernels().compressor_backward(p, g, AtenExecutor()); });
  return {dx, dwkv, dwgate, dape};
}

Outputs4 compressor_backward_meta(const CompressorBackwardCall& c) {
  check_grad_cmp_kv(c, check_compressor_args(c));
  return backward_outputs(c);
}

// The state cache is written in place: its version counter advances above the kernel.
at::Tensor compressor_inplace_or_view(const CompressorCall& c) {
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = std::get<0>(tensors_of<1>(call_op(c)));
  }
  c.state_cache.unsafeGetTensorImpl()->bump_version();
  if (c.projections) c.projections->unsafeGetTensorImpl()->bump_version();
  return out;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class CompressorFunction : public torch::autograd::Function<CompressorFunction> {
 public:
  // The forward keeps every token's projections (the caller's buffer, or one of its own) for the
  // backward, which then runs two products instead of three.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& wkv,
                               const at::Tensor& wgate, const at::Tensor& ape,
                               const CompressorCall& forward_call) {
    CompressorCall call = forward_call;
    if (!call.projections) {
      call.projections =
          at::empty_symint(projections_shape(x, wkv.sym_size(0)), x.options().dtype(at::kFloat));
    }
    at::Tensor out;
    {
      at::AutoDispatchBelowAutograd guard;  // ADInplaceOrView still counts the state's write
      out = std::get<0>(tensors_of<1>(call_op(call)));
    }
    ctx->save_for_backward({x, wkv, wgate, ape, *call.projections});
    CompressorBackwardCall g;
    ops::copy_compressor_shared(call, g);
    torch::jit::Stack packed;
    push_call(packed, g);
    ctx->saved_data["backward"] = c10::ivalue::Tuple::create(std::move(packed));
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    auto g = call_from_stack<CompressorBackwardCall>(
        ctx->saved_data["backward"].toTupleRef().elements());
    g.x = saved[0];
    g.wkv = saved[1];
    g.wgate = saved[2];
    g.ape = saved[3];
    g.projections = saved[4];
    g.grad_cmp_kv = grad_outputs[0];
    auto [dx, dwkv, dwgate, dape] = tensors_of<4>(call_op(g));
    return {dx, dwkv, dwgate, dape, at::Tensor()};
  }
};

at::Tensor compressor_autograd(const CompressorCall& c) {
  TORCH_CHECK_VALUE(!c.state_cache.requires_grad(),
                    "state_cache: requires a gradient, but the state cache is a buffer the call "
                    "writes, with no gradient; pass a detached tensor");
  const bool needs_grad =
      at::GradMode::is_enabled() && (c.x.requires_grad() || c.wkv.requires_grad() ||
                                     c.wgate.requires_grad() || c.ape.requires_grad());
  if (!needs_grad) {
    at::AutoDispatchBelowAutograd guard;
    return std::get<0>(tensors_of<1>(call_op(c)));
  }
  return CompressorFunction::apply(c.x, c.wkv, c.wgate, c.ape, c)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, Autograd, m) { impl<CompressorCall, compressor_autograd>(m); }
TORCH_LIBRARY_IMPL(opmesh, CPU, m) {
  impl<CompressorCall, compressor_cpu>(m);
  impl<CompressorBackwardCall, compressor_backward_cpu>(m);
}
TORCH_LIBRARY_IMPL(opmesh, ADInplaceOrView, m) {
  impl<CompressorCall, compressor_inplace_or_view>(m);
}
TORCH_LIBRARY_IMPL(opmesh, Meta, m) {
  impl<CompressorCall, compressor_meta>(m);
  impl<CompressorBackwardCall, compressor_backward_meta>(m);
}

}  // namespace opmesh::binding
