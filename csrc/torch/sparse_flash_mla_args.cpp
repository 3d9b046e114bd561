#include "sparse_flash_mla_args.h"

#include <ATen/ATen.h>

#include <cmath>
#include <string>
#include <vector>

#include "checks.h"
#include "conventions.h"
#include "dtypes.h"
#include "output_memory.h"
#include "sequence_args.h"

namespace opmesh::binding {
namespace {

using OptTensor = std::optional<at::Tensor>;

void check_int(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name,
                   ": expected int32 or int64, got ", t.scalar_type());
}

// Every dim of t but its last `tail` equals q's leading dims (q without its last two).
void check_query_leading(const at::Tensor& t, const at::Tensor& q, int64_t rank, const char* name,
                         const char* what) {
  TORCH_CHECK_VALUE(t.dim() == rank, name, ": expected a ", rank, "-D tensor (", what,
                    "), got shape ", t.sizes());
  for (int64_t i = 0; i + 2 < q.dim(); ++i) {
    TORCH_CHECK_VALUE(holds(t.sym_size(i) == q.sym_size(i)), name, ": expected leading dims ",
                      q.sym_sizes().slice(0, q.dim() - 2), " like q, got ", t.sym_sizes());
  }
}

// One key tensor (ori_kv or cmp_kv) and what belongs to it: its selection, topk lengths, block
// table and length arrays.
struct Side {
  const OptTensor* kv;
  const OptTensor* indices;
  const OptTensor* topk_length;
  const OptTensor* table;
  const OptTensor* cu;
  const OptTensor* used;
  const char* kv_name;
  const char* indices_name;
  const char* topk_name;
  const char* table_name;
  const char* cu_name;
  const char* used_name;
  // The forward's row scales of a quantized kv (nullptr: the backward, which takes none).
  const OptTensor* scale;
  const char* scale_name;
};

// A quantized kv's row scales; a plain kv takes none.
void check_scale(const Side& s, const at::Tensor& q) {
  const at::Tensor& kv = **s.kv;
  if (cache_format_of(kv.scalar_type()) != core::CacheFormat::kPlain) {
    return check_row_scales(*s.scale, s.scale_name, kv, s.kv_name, q.device());
  }
  TORCH_CHECK_VALUE(!s.scale->has_value(), s.scale_name, ": given, but ", s.kv_name, " is ",
                    kv.scalar_type(), ", not a quantized kv (int8 or float8_e4m3fn)");
}

void check_side(const Side& s, const at::Tensor& q, MlaArgs& a, const c10::SymInt& batch) {
  const int64_t q_rank = a.tnd ? 3 : 4;
  if (s.kv->has_value()) {
    const at::Tensor& kv = **s.kv;
    TORCH_CHECK_VALUE(kv.device() == q.device(), s.kv_name, ": expected a tensor on ", q.device(),
                      " like q, got ", kv.device());
    const bool quantized = cache_format_of(kv.scalar_type()) != core::CacheFormat::kPlain;
    TORCH_CHECK_TYPE(kv.scalar_type() == q.scalar_type() || (quantized && s.scale != nullptr),
                     s.kv_name, ": expected dtype ", q.scalar_type(), " like q",
                     quantized ? " (a quantized kv has no backward)" : "", ", got ",
                     kv.scalar_type());
    const int64_t rank = a.paged ? 4 : q_rank;
    TORCH_CHECK_VALUE(kv.dim() == rank, s.kv_name, ": expected a ", rank, "-D ",
                      a.paged ? "PA_BBND" : (a.tnd ? "TND" : "BSND"), " tensor, got shape ",
                      kv.sizes());
    TORCH_CHECK_VALUE(concrete(kv.sym_size(-1)) == a.d, s.kv_name, ": head dim ", kv.sym_size(-1),
                      " differs from q's ", a.d);
    const int64_t n2 = concrete(kv.sym_size(-2));
    TORCH_CHECK_VALUE(a.n2 == 0 || n2 == a.n2, s.kv_name, ": expected ", a.n2,
                      " heads like the other key tensor, got shape ", kv.sym_sizes());
    a.n2 = n2;
    TORCH_CHECK_VALUE(a.no_heads || (a.n2 >= 1 && a.n1 % a.n2 == 0), s.kv_name, ": its ", a.n2,
                      " heads must divide q's ", a.n1);
    if (!a.tnd && !a.paged) {
      TORCH_CHECK_VALUE(holds(kv.sym_size(0) == q.sym_size(0)), s.kv_name, ": batch ",
                        kv.sym_size(0), " differs from q's ", q.sym_size(0));
    }
    if (s.scale != nullptr) check_scale(s, q);
  } else {
    if (s.scale != nullptr) {
      TORCH_CHECK_VALUE(!s.scale->has_value(), s.scale_name, ": given without ", s.kv_name);
    }
    for (const auto& [t, name] : {std::pair{s.indices, s.indices_name},
                                  {s.topk_length, s.topk_name},
                                  {s.table, s.table_name},
                                  {s.cu, s.cu_name},
                                  {s.used, s.used_name}}) {
      TORCH_CHECK_VALUE(!t->has_value(), name, ": given without ", s.kv_name);
    }
    return;
  }
  if (s.indices->has_value()) {
    const at::Tensor& idx = **s.indices;
    TORCH_CHECK_VALUE(idx.device() == q.device(), s.indices_name, ": expected a tensor on ",
                      q.device(), " like q, got ", idx.device());
    check_int(idx, s.indices_name);
    check_query_leading(idx, q, q_rank, s.indices_name, "q's leading dims, key heads, K");
    TORCH_CHECK_VALUE(a.no_heads || concrete(idx.sym_size(-2)) == a.n2, s.indices_name,
                      ": expected ", a.n2, " key heads, got shape ", idx.sym_sizes());
  }
  if (s.topk_length->has_value()) {
    const at::Tensor& len = **s.topk_length;
    TORCH_CHECK_VALUE(s.indices->has_value(), s.topk_name, ": given without ", s.indices_name);
    TORCH_CHECK_VALUE(len.device() == q.device(), s.topk_name, ": expected a tensor on ",
                      q.device(), " like q, got ", len.device());
    check_int(len, s.topk_name);
    check_query_leading(len, q, q_rank - 1, s.topk_name, "q's leading dims, key heads");
    TORCH_CHECK_VALUE(a.no_heads || concrete(len.sym_size(-1)) == a.n2, s.topk_name, ": expected ",
                      a.n2, " key heads, got shape ", len.sym_sizes());
  }
  if (a.paged) {
    TORCH_CHECK_VALUE(s.table->has_value(), s.table_name, ": required with layout_kv PA_BBND");
    check_int(**s.table, s.table_name);
    TORCH_CHECK_VALUE((*s.table)->dim() == 2 && holds((*s.table)->sym_size(0) == batch),
                      s.table_name, ": expected ", batch, " rows (one per sequence), got shape ",
                      (*s.table)->sym_sizes());
  } else {
    TORCH_CHECK_VALUE(!s.table->has_value(), s.table_name, ": only read with layout_kv PA_BBND");
  }
  if (s.cu->has_value()) {
    check_int(**s.cu, s.cu_name);
    TORCH_CHECK_VALUE((*s.cu)->dim() == 1 && holds((*s.cu)->sym_size(0) == batch + 1), s.cu_name,
                      ": expected ", batch + 1, " entries (from 0), got shape ",
                      (*s.cu)->sym_sizes());
  }
  check_per_sequence(*s.used, s.used_name, batch);
}

}  // namespace

template <class Call>
MlaArgs check_sparse_flash_mla_args(const Call& c) {
  const at::Tensor& q = c.q;
  MlaArgs a;
  const core::Layout lq =
      rethrow([&] { return conventions::attention_layout(c.layout_q, "layout_q"); });
  const core::Layout lkv =
      rethrow([&] { return conventions::attention_layout(c.layout_kv, "layout_kv"); });
  TORCH_CHECK_VALUE(lq == core::Layout::kBSND || lq == core::Layout::kTND,
                    "layout_q: expected 'BSND' or 'TND', got '", c.layout_q, "'");
  a.tnd = lq == core::Layout::kTND;
  a.paged = lkv == core::Layout::kPagedBBND;
  TORCH_CHECK_VALUE(a.paged || lkv == lq, "layout_kv: expected '", c.layout_q,
                    "' like layout_q, or 'PA_BBND', got '", c.layout_kv, "'");
  // The length arrays and block tables on q's device: one elsewhere (a meta tensor) would send
  // the call to that device's kernel, which gives shapes, not values.
  check_same_device(q, "q", {},
                    {{&c.cu_seqlens_q, "cu_seqlens_q"},
                     {&c.cu_seqlens_ori_kv, "cu_seqlens_ori_kv"},
                     {&c.cu_seqlens_cmp_kv, "cu_seqlens_cmp_kv"},
                     {&c.seqused_q, "seqused_q"},
                     {&c.seqused_ori_kv, "seqused_ori_kv"},
                     {&c.seqused_cmp_kv, "seqused_cmp_kv"},
                     {&c.cmp_residual_kv, "cmp_residual_kv"},
                     {&c.ori_block_table, "ori_block_table"},
                     {&c.cmp_block_table, "cmp_block_table"}});
  to_core_dtype(q.scalar_type(), "q");
  const int64_t q_rank = a.tnd ? 3 : 4;
  TORCH_CHECK_VALUE(q.dim() == q_rank, "q: expected a ", q_rank, "-D ", a.tnd ? "TND" : "BSND",
                    " tensor, got shape ", q.sizes());
  a.n1 = concrete(q.sym_size(-2));
  a.d = concrete(q.sym_size(-1));
  a.no_heads = a.n1 == 0;
  TORCH_CHECK_VALUE(a.n1 <= core::kMaxHeads, "q: head count must be <= ", core::kMaxHeads,
                    ", got shape ", q.sym_sizes());
  TORCH_CHECK_VALUE(a.d >= 1 && a.d <= core::kMaxHeadDim, "q: head dim must be in [1, ",
                    core::kMaxHeadDim, "], got shape ", q.sym_sizes());
  TORCH_CHECK_VALUE(c.ori_kv.has_value() || c.cmp_kv.has_value(),
                    "ori_kv: and cmp_kv are both absent: a call needs at least one");
  TORCH_CHECK_VALUE(std::isfinite(c.softmax_scale), "softmax_scale: must be finite, got ",
                    c.softmax_scale);
  TORCH_CHECK_VALUE(!a.tnd || c.cu_seqlens_q.has_value(),
                    "cu_seqlens_q: required with layout_q TND");
  TORCH_CHECK_VALUE(a.tnd || !c.cu_seqlens_q.has_value(),
                    "cu_seqlens_q: only accepted with layout_q TND");
  if (c.cu_seqlens_q) {
    check_int(*c.cu_seqlens_q, "cu_seqlens_q");
    TORCH_CHECK_VALUE(c.cu_seqlens_q->dim() == 1 && c.cu_seqlens_q->sym_size(0) >= 1,
                      "cu_seqlens_q: expected a 1-D tensor of B + 1 entries, got shape ",
                      c.cu_seqlens_q->sym_sizes());
  }
  const c10::SymInt batch = a.tnd ? c.cu_seqlens_q->sym_size(0) - 1 : q.sym_size(0);
  check_per_sequence(c.seqused_q, "seqused_q", batch);
  check_per_sequence(c.cmp_residual_kv, "cmp_residual_kv", batch);
  const OptTensor* scales[2] = {nullptr, nullptr};
  if constexpr (requires { c.ori_kv_scale; }) {
    scales[0] = &c.ori_kv_scale;
    scales[1] = &c.cmp_kv_scale;
  }
  const Side ori{&c.ori_kv,          &c.ori_sparse_indices, &c.ori_topk_length,
                 &c.ori_block_table, &c.cu_seqlens_ori_kv,  &c.seqused_ori_kv,
                 "ori_kv",           "ori_sparse_indices",  "ori_topk_length",
                 "ori_block_table",  "cu_seqlens_ori_kv",   "seqused_ori_kv",
                 scales[0],          "ori_kv_scale"};
  const Side cmp{&c.cmp_kv,          &c.cmp_sparse_indices, &c.cmp_topk_length,
                 &c.cmp_block_table, &c.cu_seqlens_cmp_kv,  &c.seqused_cmp_kv,
                 "cmp_kv",           "cmp_sparse_indices",  "cmp_topk_length",
                 "cmp_block_table",  "cu_seqlens_cmp_kv",   "seqused_cmp_kv",
                 scales[1],          "cmp_kv_scale"};
  check_side(ori, q, a, batch);
  check_side(cmp, q, a, batch);
  if (c.sinks) {
    TORCH_CHECK_VALUE(c.sinks->device() == q.device(), "sinks: expected a tensor on ", q.device(),
                      " like q, got ", c.sinks->device());
    TORCH_CHECK_TYPE(at::isFloatingType(c.sinks->scalar_type()),
                     "sinks: expected a floating dtype, got ", c.sinks->scalar_type());
    TORCH_CHECK_VALUE(c.sinks->dim() == 1 && concrete(c.sinks->sym_size(0)) == a.n1,
                      "sinks: expected shape [", a.n1, "] (one per query head), got ",
                      c.sinks->sym_sizes());
  }
  return a;
}

template MlaArgs check_sparse_flash_mla_args(const SparseFlashMlaCall&);
template MlaArgs check_sparse_flash_mla_args(const SparseFlashMlaBackwardCall&);

std::tuple<at::Tensor, at::Tensor> sparse_flash_mla_outputs(const at::Tensor& q, const MlaArgs& a,
                                                            bool return_lse) {
  at::Tensor out = at::empty_symint(q.sym_sizes(), q.options());
  advise_huge_pages(out);
  const auto f32 = q.options().dtype(at::kFloat);
  if (!return_lse) return {out, at::zeros({}, f32)};
  const c10::SymInt g(a.n2 > 0 ? a.n1 / a.n2 : 0);
  const c10::SymInt n2(a.n2);
  std::vector<c10::SymInt> shape;
  if (a.tnd) {
    shape = {n2, q.sym_size(0), g};
  } else {
    shape = {q.sym_size(0), n2, q.sym_size(1), g};
  }
  return {out, at::empty_symint(shape, f32)};
}

}  // namespace opmesh::binding
