#include "flash_attn_args.h"

#include <ATen/ops/empty.h>

#include <cmath>
#include <tuple>
#include <utility>

#include "dtypes.h"
#include "errors.h"
#include "flash_attn_params.h"

namespace opmesh::binding {
namespace {

using OptTensor = std::optional<at::Tensor>;

void check_rank(const at::Tensor& t, attn::Layout layout, const char* name) {
  const Axes a = axes_of(layout);
  if (t.dim() == a.rank) return;
  const std::string argument = std::string("layout_") + (name[0] == 'q' ? "q" : "kv");
  std::string hint;
  if (t.dim() == 3 && layout != attn::Layout::kTND) {
    hint = "; packed tokens [T, N, D] need " + argument + "='TND' and cu_seqlens";
  } else if (t.dim() == 4 && layout == attn::Layout::kTND) {
    hint = "; a batch [B, S, N, D] needs " + argument + "='BSND' (or 'BNSD' for [B, N, S, D]" +
           (name[0] == 'q' ? ")" : ", 'PA_BBND' for a paged cache)");
  }
  TORCH_CHECK_VALUE(false, name, ": expected a ", a.rank, "-D ", attn::layout_name(layout),
                    " tensor, got ", t.dim(), "-D with shape ", t.sizes(), hint);
}

void check_device(const OptTensor& t, const char* name, const at::Device& device) {
  if (t.has_value()) {
    TORCH_CHECK_VALUE(t->device() == device, name, ": expected a tensor on ", device,
                      " like q, got ", t->device());
  }
}

void check_int32_vector(const OptTensor& t, const char* name, const c10::SymInt& count) {
  if (!t.has_value()) return;
  TORCH_CHECK_TYPE(t->scalar_type() == at::kInt, name, ": expected int32, got ", t->scalar_type());
  TORCH_CHECK_VALUE(t->dim() == 1, name, ": expected a 1-D tensor, got shape ", t->sizes());
  TORCH_CHECK_VALUE(holds(t->sym_size(0) == count), name, ": expected ", count, " entries, got ",
                    t->sym_size(0));
}

void check_tokens(const c10::SymInt& size, const char* name, const char* what) {
  TORCH_CHECK_VALUE(holds(size <= attn::kMaxTokens), name, ": ", what, " ", size,
                    " exceeds the limit of ", attn::kMaxTokens);
}

}  // namespace

Axes axes_of(attn::Layout layout) {
  const common::AttentionAxes a = common::attention_axes(layout);
  return {a.b, a.s, a.n, a.d, layout == attn::Layout::kTND ? 3 : 4};
}

void check_plan_lengths(const OptTensor& t, const char* name, const c10::SymInt& count) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->device().type() != c10::DeviceType::Meta, name,
                    ": the plan reads the lengths' values; a meta tensor cannot be planned for");
  check_int32_vector(t, name, count);
}

namespace {

// Devices and dtypes: every tensor on q's device (the plan on the host or there), q's dtype one
// the kernels read, k and v like it, the int32 and float32 side tensors as such.
void check_devices_and_dtypes(const FlashAttnCall& a) {
  const at::Device device = a.q.device();
  check_device(a.k, "k", device);
  check_device(a.v, "v", device);
  for (const auto& [t, name] : {std::pair{&a.block_table, "block_table"},
                                {&a.cu_seqlens_q, "cu_seqlens_q"},
                                {&a.cu_seqlens_kv, "cu_seqlens_kv"},
                                {&a.seqused_q, "seqused_q"},
                                {&a.seqused_kv, "seqused_kv"},
                                {&a.sinks, "sinks"}}) {
    check_device(*t, name, device);
  }
  const OptTensor& metadata = a.metadata;
  if (metadata.has_value()) {
    TORCH_CHECK_VALUE(metadata->device().is_cpu() || metadata->device() == device,
                      "metadata: expected a CPU tensor (as flash_attn_metadata returns) or one on ",
                      device, ", got ", metadata->device());
  }
  to_core_dtype(a.q.scalar_type(), "q");
  if (cache_format_of(a.k.scalar_type()) == core::CacheFormat::kPlain) {
    TORCH_CHECK_TYPE(a.k.scalar_type() == a.q.scalar_type(), "k: expected dtype ",
                     a.q.scalar_type(), " like q (or int8 / float8_e4m3fn with k_scale), got ",
                     a.k.scalar_type());
    TORCH_CHECK_TYPE(a.v.scalar_type() == a.q.scalar_type(), "v: expected dtype ",
                     a.q.scalar_type(), " like q, got ", a.v.scalar_type());
    for (const auto& [t, name] : {std::pair{&a.k_scale, "k_scale"}, {&a.v_scale, "v_scale"}}) {
      TORCH_CHECK_VALUE(!t->has_value(), name, ": given, but k is ", a.k.scalar_type(),
                        ", not a quantized cache (int8 or float8_e4m3fn)");
    }
  } else {
    TORCH_CHECK_TYPE(a.v.scalar_type() == a.k.scalar_type(), "v: expected dtype ",
                     a.k.scalar_type(), " like k (a quantized cache), got ", a.v.scalar_type());
    // (Their scales are checked with the shapes, check_heads.)
  }
  if (a.sinks.has_value()) {
    TORCH_CHECK_TYPE(a.sinks->scalar_type() == at::kFloat, "sinks: expected float32, got ",
                     a.sinks->scalar_type());
  }
  if (a.block_table.has_value()) {
    TORCH_CHECK_TYPE(a.block_table->scalar_type() == at::kInt, "block_table: expected int32, got ",
                     a.block_table->scalar_type());
  }
  if (metadata.has_value()) {
    TORCH_CHECK_TYPE(metadata->scalar_type() == at::kInt, "metadata: expected int32, got ",
                     metadata->scalar_type());
    TORCH_CHECK_VALUE(metadata->dim() == 1, "metadata: expected a 1-D tensor, got shape ",
                      metadata->sizes());
  }
}

// Layouts, their combination, then ranks (a wrong combination is named before the tensor it
// makes look wrong).
void check_layouts(const FlashAttnCall& a, FlashAttnArgs& r) {
  attn::PlanConfig& c = r.config;
  rethrow([&] {
    c.layout_q = conventions::attention_layout(a.layout_q, "layout_q");
    c.layout_kv = conventions::attention_layout(a.layout_kv, "layout_kv");
    c.layout_out = conventions::attention_layout(a.layout_out, "layout_out");
    return 0;
  });
  TORCH_CHECK_VALUE(c.layout_q != attn::Layout::kPagedBBND,
                    "layout_q: expected 'BSND', 'BNSD' or 'TND', got 'PA_BBND'");
  r.paged = c.layout_kv == attn::Layout::kPagedBBND;
  r.q_tnd = c.layout_q == attn::Layout::kTND;
  r.kv_tnd = c.layout_kv == attn::Layout::kTND;
  TORCH_CHECK_VALUE(r.paged || !a.block_table.has_value(),
                    "layout_kv: block_table is given, so k and v are a paged cache "
                    "[num_blocks, block_size, Nkv, D]: pass layout_kv='PA_BBND' (got '",
                    a.layout_kv, "')");
  TORCH_CHECK_VALUE(r.paged || c.layout_kv == c.layout_q, "layout_kv: must equal layout_q ('",
                    a.layout_q, "') or be 'PA_BBND', got '", a.layout_kv, "'");
  TORCH_CHECK_VALUE(
      r.q_tnd ? c.layout_out == attn::Layout::kTND
              : (c.layout_out == attn::Layout::kBSND || c.layout_out == attn::Layout::kBNSD),
      "layout_out: must be ", r.q_tnd ? "'TND' when layout_q is 'TND'" : "'BSND' or 'BNSD'",
      ", got '", a.layout_out, "'");
  check_rank(a.q, c.layout_q, "q");
  check_rank(a.k, c.layout_kv, "k");
  check_rank(a.v, c.layout_kv, "v");
  r.qa = axes_of(c.layout_q);
  r.ka = axes_of(c.layout_kv);
}

// Heads and head dims of q, k and v.
void check_heads(const FlashAttnCall& a, FlashAttnArgs& r) {
  attn::PlanConfig& c = r.config;
  const Axes& qa = r.qa;
  const Axes& ka = r.ka;
  c.num_heads_q = concrete(a.q.sym_size(qa.n));
  c.num_heads_kv = concrete(a.k.sym_size(ka.n));
  c.head_dim = concrete(a.q.sym_size(qa.d));
  c.head_dim_v = concrete(a.v.sym_size(ka.d));
  // A head count that does not divide q's usually means a layout argument does not match the
  // tensor: say which dims were read as heads, and which arguments to change.
  // No heads at all (q and k both with 0, as a rank's empty shard of the heads) is a call with
  // no rows: valid, its outputs empty.
  r.no_heads = c.num_heads_q == 0 && c.num_heads_kv == 0;
  TORCH_CHECK_VALUE(r.no_heads || (c.num_heads_kv > 0 && c.num_heads_q % c.num_heads_kv == 0),
                    "k: ", c.num_heads_kv, " heads (dim ", ka.n, " of ",
                    attn::layout_name(c.layout_kv), ") do not divide q's ", c.num_heads_q, " (dim ",
                    qa.n, " of ", attn::layout_name(c.layout_q),
                    "); if the tensors are laid out otherwise, set layout_kv (or layout_q) to "
                    "match them");
  TORCH_CHECK_VALUE(concrete(a.k.sym_size(ka.d)) == c.head_dim, "k: head_dim ", a.k.sym_size(ka.d),
                    " differs from q's ", c.head_dim);
  TORCH_CHECK_VALUE(concrete(a.v.sym_size(ka.n)) == c.num_heads_kv, "v: ", a.v.sym_size(ka.n),
                    " heads differ from k's ", c.num_heads_kv);
  for (int dim : {ka.b, ka.s}) {
    if (dim >= 0) {
      TORCH_CHECK_VALUE(holds(a.v.sym_size(dim) == a.k.sym_size(dim)), "v: shape ", a.v.sym_sizes(),
                        " does not match k's ", a.k.sym_sizes(), " outside the head dim");
    }
  }
  if (cache_format_of(a.k.scalar_type()) != core::CacheFormat::kPlain) {
    check_row_scales(a.k_scale, "k_scale", a.k, "k", a.q.device());
    check_row_scales(a.v_scale, "v_scale", a.v, "v", a.q.device());
  }
  if (a.sinks.has_value()) {
    TORCH_CHECK_VALUE(a.sinks->dim() == 1 && concrete(a.sinks->sym_size(0)) == c.num_heads_q,
                      "sinks: expected shape [", c.num_heads_q, "] (one per query head), got ",
                      a.sinks->sym_sizes());
  }
}

// The batch, sequence and token sizes, the length arrays and the block table.
void check_sequences(const FlashAttnCall& a, FlashAttnArgs& r) {
  const Axes& qa = r.qa;
  const Axes& ka = r.ka;
  const OptTensor& cu_seqlens_q = a.cu_seqlens_q;
  if (r.q_tnd) {
    TORCH_CHECK_VALUE(cu_seqlens_q.has_value(), "cu_seqlens_q: required for layout_q TND");
    TORCH_CHECK_VALUE(cu_seqlens_q->dim() == 1, "cu_seqlens_q: expected a 1-D tensor, got shape ",
                      cu_seqlens_q->sizes());
    TORCH_CHECK_VALUE(holds(cu_seqlens_q->sym_size(0) >= 1),
                      "cu_seqlens_q: expected batch_size + 1 >= 1 entries");
    r.batch = cu_seqlens_q->sym_size(0) - 1;
    check_tokens(a.q.sym_size(0), "q", "token count");
  } else {
    r.batch = a.q.sym_size(qa.b);
    check_tokens(a.q.sym_size(qa.s), "q", "sequence length");
  }
  TORCH_CHECK_VALUE(holds(r.batch <= attn::kMaxBatch), r.q_tnd ? "cu_seqlens_q" : "q", ": batch ",
                    r.batch, " exceeds the limit of ", attn::kMaxBatch);
  if (r.kv_tnd) {
    TORCH_CHECK_VALUE(a.cu_seqlens_kv.has_value(), "cu_seqlens_kv: required for layout_kv TND");
    check_tokens(a.k.sym_size(0), "k", "token count");
  } else if (!r.paged) {
    TORCH_CHECK_VALUE(holds(a.k.sym_size(ka.b) == r.batch), "k: batch ", a.k.sym_size(ka.b),
                      " differs from q's ", r.batch);
    check_tokens(a.k.sym_size(ka.s), "k", "sequence length");
  }
  check_int32_vector(cu_seqlens_q, "cu_seqlens_q", r.batch + 1);
  check_int32_vector(a.cu_seqlens_kv, "cu_seqlens_kv", r.batch + 1);
  check_int32_vector(a.seqused_q, "seqused_q", r.batch);
  check_int32_vector(a.seqused_kv, "seqused_kv", r.batch);
  if (r.paged) {
    const OptTensor& block_table = a.block_table;
    TORCH_CHECK_VALUE(block_table.has_value(), "block_table: required with layout_kv PA_BBND");
    TORCH_CHECK_VALUE(block_table->dim() == 2 && holds(block_table->sym_size(0) == r.batch),
                      "block_table: expected shape [", r.batch, ", max_blocks_per_seq], got ",
                      block_table->sym_sizes());
    TORCH_CHECK_VALUE(a.seqused_kv.has_value() || holds(r.batch == 0),
                      "seqused_kv: required with layout_kv PA_BBND");
    TORCH_CHECK_VALUE(holds(a.k.sym_size(1) >= 1), "k: block size must be >= 1, got shape ",
                      a.k.sym_sizes());
  }
  // A given maximum length must agree with a shape that fixes it, else lie in [0, kMaxTokens].
  auto check_max = [](const std::optional<c10::SymInt>& given, const c10::SymInt* shape,
                      const char* name) {
    if (!given.has_value()) return;
    if (shape != nullptr) {
      TORCH_CHECK_VALUE(holds(*given == *shape), name, ": ", *given,
                        " differs from the sequence length ", *shape, " of the tensor");
      return;
    }
    TORCH_CHECK_VALUE(holds(*given >= 0) && holds(*given <= attn::kMaxTokens), name,
                      ": must be in [0, ", attn::kMaxTokens, "], got ", *given);
  };
  const c10::SymInt q_len = r.q_tnd ? c10::SymInt(0) : a.q.sym_size(qa.s);
  const c10::SymInt k_len = (r.kv_tnd || r.paged) ? c10::SymInt(0) : a.k.sym_size(ka.s);
  check_max(a.max_seqlen_q, r.q_tnd ? nullptr : &q_len, "max_seqlen_q");
  check_max(a.max_seqlen_kv, (r.kv_tnd || r.paged) ? nullptr : &k_len, "max_seqlen_kv");
}

// Argument values, range-checked as int64 before anything narrows them, then the core's own
// checks of the configuration.
void check_values(const FlashAttnCall& a, FlashAttnArgs& r) {
  attn::PlanConfig& c = r.config;
  const core::Mask mask =
      rethrow([&] { return conventions::attention_mask(a.mask_mode, a.win_left, a.win_right); });
  c.mask_mode = mask.mode;
  c.win_left = mask.left;
  c.win_right = mask.right;
  c.batch_size = r.batch.is_heap_allocated() ? 0 : r.batch.expect_int();
  // Everything but the head counts is checked as for a call with heads.
  attn::PlanConfig checked = c;
  if (r.no_heads) checked.num_heads_q = checked.num_heads_kv = 1;
  rethrow([&] {
    attn::validate_config(checked);
    return 0;
  });
  const double scale = a.softmax_scale.value_or(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  r.softmax_scale = static_cast<float>(scale);
  TORCH_CHECK_VALUE(std::isfinite(r.softmax_scale),
                    "softmax_scale: must be finite as a float32, got ", scale);
}

}  // namespace

// softcap's value and alibi_slopes' device, dtype and shape ([Nq] or [B, Nq]).
void check_score_mods(const FlashAttnCall& a, const FlashAttnArgs& r) {
  check_softcap(a.softcap);
  if (!a.alibi_slopes.has_value()) return;
  const at::Tensor& s = *a.alibi_slopes;
  TORCH_CHECK_VALUE(s.device() == a.q.device(), "alibi_slopes: expected a tensor on ", a.q.device(),
                    " like q, got ", s.device());
  TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, "alibi_slopes: expected float32, got ",
                   s.scalar_type());
  const int64_t nq = r.config.num_heads_q;
  const bool per_head = s.dim() == 1 && holds(s.sym_size(0) == nq);
  const bool per_batch =
      s.dim() == 2 && holds(s.sym_size(0) == r.batch) && holds(s.sym_size(1) == nq);
  TORCH_CHECK_VALUE(per_head || per_batch, "alibi_slopes: expected shape [", nq, "] or [", r.batch,
                    ", ", nq, "] (per query head, or per batch entry and query head), got ",
                    s.sym_sizes());
}

FlashAttnArgs check_flash_attn_args(const FlashAttnCall& call) {
  FlashAttnArgs r;
  check_devices_and_dtypes(call);
  check_layouts(call, r);
  check_heads(call, r);
  check_sequences(call, r);
  check_values(call, r);
  check_score_mods(call, r);
  return r;
}

std::tuple<at::Tensor, at::Tensor> flash_attn_outputs(const at::Tensor& q, const at::Tensor& v,
                                                      const FlashAttnArgs& args,
                                                      bool return_softmax_lse) {
  const Axes& qa = args.qa;
  const c10::SymInt nq = q.sym_size(qa.n);
  const c10::SymInt dv = v.sym_size(args.ka.d);
  const auto lse_options = q.options().dtype(at::kFloat);
  const at::Tensor no_lse = at::empty({0}, lse_options);
  if (args.q_tnd) {
    const c10::SymInt t = q.sym_size(0);
    return {at::empty_symint({t, nq, dv}, q.options()),
            return_softmax_lse ? at::empty_symint({nq, t}, lse_options) : no_lse};
  }
  const c10::SymInt b = q.sym_size(qa.b);
  const c10::SymInt s = q.sym_size(qa.s);
  const bool bnsd = args.config.layout_out == attn::Layout::kBNSD;
  return {bnsd ? at::empty_symint({b, nq, s, dv}, q.options())
               : at::empty_symint({b, s, nq, dv}, q.options()),
          return_softmax_lse ? at::empty_symint({b, nq, s}, lse_options) : no_lse};
}

}  // namespace opmesh::binding
