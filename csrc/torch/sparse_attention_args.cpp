#include "sparse_attention_args.h"

#include <ATen/ATen.h>

#include <cmath>
#include <tuple>

#include "checks.h"
#include "dtypes.h"
#include "indexer_checks.h"
#include "lightning_indexer_args.h"
#include "output_memory.h"

namespace opmesh::binding {
namespace {

// Every dim of `t` but the last two equals `like`'s (the leading dims of a layout).
void check_leading(const at::Tensor& t, const at::Tensor& like, const char* name,
                   const char* like_name) {
  for (int64_t i = 0; i + 2 < like.dim(); ++i) {
    TORCH_CHECK_VALUE(holds(t.sym_size(i) == like.sym_size(i)), name, ": expected leading dims ",
                      like.sym_sizes().slice(0, like.dim() - 2), " like ", like_name, ", got ",
                      t.sym_sizes());
  }
}

// A quantized key and value: value of key's dtype, and their row scales.
void check_quantized_kv(const SparseFlashAttentionCall& c) {
  TORCH_CHECK_TYPE(c.value.scalar_type() == c.key.scalar_type(), "value: expected dtype ",
                   c.key.scalar_type(), " like key (a quantized key), got ", c.value.scalar_type());
  check_row_scales(c.key_scale, "key_scale", c.key, "key", c.query.device());
  check_row_scales(c.value_scale, "value_scale", c.value, "value", c.query.device());
}

// Every tensor on query's device, and the dtypes the operator takes.
template <class Call>
void check_devices_and_dtypes(const Call& c) {
  const at::Tensor& q = c.query;
  const at::Tensor& k = c.key;
  const at::Tensor& v = c.value;
  const at::Tensor& idx = c.sparse_indices;
  check_same_device(q, "query", {{&k, "key"}, {&v, "value"}, {&idx, "sparse_indices"}},
                    {{&c.query_rope, "query_rope"},
                     {&c.key_rope, "key_rope"},
                     {&c.sinks, "sinks"},
                     {&c.block_table, "block_table"},
                     {&c.actual_seq_lengths_query, "actual_seq_lengths_query"},
                     {&c.actual_seq_lengths_kv, "actual_seq_lengths_kv"}});
  to_core_dtype(q.scalar_type(), "query");
  // The forward takes a quantized key and value with their row scales.
  const bool quantized = cache_format_of(k.scalar_type()) != core::CacheFormat::kPlain;
  bool quantized_checked = false;
  if constexpr (requires { c.key_scale; }) {
    if (quantized) check_quantized_kv(c);
    quantized_checked = quantized;
  }
  if (!quantized_checked) {
    for (const auto& [t, name] : {std::pair{&k, "key"}, {&v, "value"}}) {
      TORCH_CHECK_TYPE(t->scalar_type() == q.scalar_type(), name, ": expected dtype ",
                       q.scalar_type(), " like query",
                       quantized ? " (a quantized key has no backward)" : "", ", got ",
                       t->scalar_type());
    }
  }
  if constexpr (requires { c.key_scale; }) {
    for (const auto& [t, name] :
         {std::pair{&c.key_scale, "key_scale"}, {&c.value_scale, "value_scale"}}) {
      TORCH_CHECK_VALUE(quantized || !t->has_value(), name, ": given, but key is ", k.scalar_type(),
                        ", not a quantized key (int8 or float8_e4m3fn)");
    }
  }
  for (const auto& [t, name] :
       {std::pair{&c.query_rope, "query_rope"}, {&c.key_rope, "key_rope"}}) {
    if (t->has_value()) {
      TORCH_CHECK_TYPE((*t)->scalar_type() == q.scalar_type(), name, ": expected dtype ",
                       q.scalar_type(), " like query, got ", (*t)->scalar_type());
    }
  }
  TORCH_CHECK_TYPE(idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong,
                   "sparse_indices: expected int32 or int64, got ", idx.scalar_type());
  if (c.sinks) {
    TORCH_CHECK_TYPE(at::isFloatingType(c.sinks->scalar_type()),
                     "sinks: expected a floating dtype, got ", c.sinks->scalar_type());
  }
}

// The rope parts (both or neither, shaped like query and key with their own head dim) and sinks.
template <class Call>
void check_ropes_and_sinks(const Call& c, SparseAttnArgs& a, int64_t q_rank, int64_t kv_rank) {
  const at::Tensor& q = c.query;
  const at::Tensor& k = c.key;
  TORCH_CHECK_VALUE(c.query_rope.has_value() == c.key_rope.has_value(),
                    c.query_rope.has_value() ? "key_rope" : "query_rope",
                    ": query_rope and key_rope are given together or not at all");
  if (c.query_rope) {
    const at::Tensor& qr = *c.query_rope;
    const at::Tensor& kr = *c.key_rope;
    TORCH_CHECK_VALUE(qr.dim() == q_rank, "query_rope: expected a ", q_rank,
                      "-D tensor like query, got shape ", qr.sizes());
    TORCH_CHECK_VALUE(kr.dim() == kv_rank, "key_rope: expected a ", kv_rank,
                      "-D tensor like key, got shape ", kr.sizes());
    check_leading(qr, q, "query_rope", "query");
    check_leading(kr, k, "key_rope", "key");
    a.dr = concrete(qr.sym_size(-1));
    TORCH_CHECK_VALUE(concrete(qr.sym_size(-2)) == a.n1, "query_rope: expected ", a.n1,
                      " heads like query, got shape ", qr.sym_sizes());
    TORCH_CHECK_VALUE(concrete(kr.sym_size(-2)) == a.n2, "key_rope: expected ", a.n2,
                      " heads like key, got shape ", kr.sym_sizes());
    TORCH_CHECK_VALUE(concrete(kr.sym_size(-1)) == a.dr, "key_rope: head dim ", kr.sym_size(-1),
                      " differs from query_rope's ", a.dr);
    TORCH_CHECK_VALUE(a.d + a.dr <= core::kMaxHeadDim,
                      "query_rope: D + Dr must be <= ", core::kMaxHeadDim);
  }
  if (c.sinks) {
    TORCH_CHECK_VALUE(c.sinks->dim() == 1 && concrete(c.sinks->sym_size(0)) == a.n1,
                      "sinks: expected shape [", a.n1, "] (one per query head), got ",
                      c.sinks->sym_sizes());
  }
}

}  // namespace

template <class Call>
SparseAttnArgs check_sparse_attention_args(const Call& c) {
  check_devices_and_dtypes(c);
  const at::Tensor& q = c.query;
  const at::Tensor& k = c.key;
  const at::Tensor& v = c.value;
  const at::Tensor& idx = c.sparse_indices;

  SparseAttnArgs a;
  a.layout_query =
      rethrow([&] { return conventions::indexer_layout(c.layout_query, "layout_query"); });
  a.layout_kv = rethrow([&] { return conventions::indexer_key_layout(c.layout_kv, "layout_kv"); });
  a.tnd = a.layout_query == core::Layout::kTND;
  a.paged = a.layout_kv == core::Layout::kPagedBBND;
  TORCH_CHECK_VALUE(a.paged || a.layout_kv == a.layout_query, "layout_kv: expected '",
                    c.layout_query, "' like layout_query, or 'PA_BSND', got '", c.layout_kv, "'");
  rethrow([&] { return conventions::indexer_mask(c.sparse_mode, c.pre_tokens, c.next_tokens); });
  TORCH_CHECK_VALUE(c.attention_mode == 0 || c.attention_mode == 2,
                    "attention_mode: expected 0 (key and value apart) or 2 (MLA absorb: key and "
                    "value the same tensor), got ",
                    c.attention_mode);
  TORCH_CHECK_VALUE(c.sparse_block_size >= 1, "sparse_block_size: must be >= 1, got ",
                    c.sparse_block_size);
  TORCH_CHECK_VALUE(std::isfinite(c.scale_value), "scale_value: must be finite, got ",
                    c.scale_value);

  const int64_t q_rank = a.tnd ? 3 : 4;
  const int64_t kv_rank = a.paged ? 4 : q_rank;
  TORCH_CHECK_VALUE(q.dim() == q_rank, "query: expected a ", q_rank, "-D ", a.tnd ? "TND" : "BSND",
                    " tensor, got shape ", q.sizes());
  for (const auto& [t, name] : {std::pair{&k, "key"}, {&v, "value"}}) {
    TORCH_CHECK_VALUE(t->dim() == kv_rank, name, ": expected a ", kv_rank, "-D ",
                      a.paged ? "PA_BSND" : (a.tnd ? "TND" : "BSND"), " tensor, got shape ",
                      t->sizes());
  }
  TORCH_CHECK_VALUE(idx.dim() == q_rank, "sparse_indices: expected a ", q_rank,
                    "-D tensor (query's leading dims, key heads, K), got shape ", idx.sizes());
  a.n1 = concrete(q.sym_size(-2));
  a.d = concrete(q.sym_size(-1));
  a.n2 = concrete(k.sym_size(-2));
  a.dv = concrete(v.sym_size(-1));
  a.no_heads = a.n1 == 0 && a.n2 == 0;
  check_heads(q, k, a.n1, a.n2, a.d, a.no_heads);
  TORCH_CHECK_VALUE(concrete(v.sym_size(-2)) == a.n2, "value: expected ", a.n2,
                    " heads like key, got shape ", v.sym_sizes());
  TORCH_CHECK_VALUE(a.dv >= 1 && a.dv <= core::kMaxHeadDim, "value: head dim must be in [1, ",
                    core::kMaxHeadDim, "], got shape ", v.sym_sizes());
  for (int64_t i = 0; i + 2 < k.dim(); ++i) {
    TORCH_CHECK_VALUE(holds(v.sym_size(i) == k.sym_size(i)), "value: expected leading dims ",
                      k.sym_sizes().slice(0, k.dim() - 2), " like key, got ", v.sym_sizes());
  }
  if (c.attention_mode == 2) {
    // Shape functions see key and value as two tensors without data (Inductor gives each
    // argument its own fake): there the layouts must agree, and the kernel checks the memory.
    const bool same_layout = v.sym_sizes() == k.sym_sizes() && v.sym_strides() == k.sym_strides();
    TORCH_CHECK_VALUE(v.is_same(k) || (same_layout && (k.is_meta() || v.is_meta() ||
                                                       v.data_ptr() == k.data_ptr())),
                      "value: attention_mode=2 (MLA absorb) takes key and value as the same "
                      "tensor");
  }
  if (!a.tnd && !a.paged) {
    TORCH_CHECK_VALUE(holds(k.sym_size(0) == q.sym_size(0)), "key: batch ", k.sym_size(0),
                      " differs from query's ", q.sym_size(0));
  }
  check_leading(idx, q, "sparse_indices", "query");
  a.index_heads = concrete(idx.sym_size(-2));
  a.k = concrete(idx.sym_size(-1));
  TORCH_CHECK_VALUE(a.no_heads || a.index_heads == 1 || a.index_heads == a.n2,
                    "sparse_indices: key-head dim must be 1 or N2=", a.n2, ", got shape ",
                    idx.sym_sizes());
  check_ropes_and_sinks(c, a, q_rank, kv_rank);
  check_softcap(c.softcap);
  check_query_key_lengths(q, c.actual_seq_lengths_query, c.actual_seq_lengths_kv, c.block_table,
                          a.tnd, a.paged, "layout_kv", "actual_seq_lengths_kv", c.layout_kv);
  return a;
}

template SparseAttnArgs check_sparse_attention_args(const SparseFlashAttentionCall&);
template SparseAttnArgs check_sparse_attention_args(const SparseFlashAttentionBackwardCall&);

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attention_outputs(const at::Tensor& q,
                                                                        const SparseAttnArgs& a,
                                                                        bool return_lse) {
  std::vector<c10::SymInt> out_shape(q.sym_sizes().begin(), q.sym_sizes().end());
  out_shape.back() = c10::SymInt(a.dv);
  at::Tensor out = at::empty_symint(out_shape, q.options());
  advise_huge_pages(out);
  const auto f32 = q.options().dtype(at::kFloat);
  if (!return_lse) return {out, at::empty({0}, f32), at::empty({0}, f32)};
  const c10::SymInt g(a.n2 > 0 ? a.n1 / a.n2 : 0);
  std::vector<c10::SymInt> shape;
  if (a.tnd) {
    shape = {c10::SymInt(a.n2), q.sym_size(0), g};
  } else {
    shape = {q.sym_size(0), c10::SymInt(a.n2), q.sym_size(1), g};
  }
  return {out, at::empty_symint(shape, f32), at::empty_symint(shape, f32)};
}

}  // namespace opmesh::binding
