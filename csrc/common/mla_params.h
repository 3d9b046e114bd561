// The core's params of sparse_flash_mla and its backward from a checked call struct of either
// binding, in the two steps of sequence_params.h: `sparse_flash_mla_params(call, host)` (layouts,
// masks, sizes, options, host arrays), then `point_sparse_flash_mla(params, call)` (pointers and
// strides).
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention/mla_plan.h"
#include "attention/sparse_flash_mla.h"
#include "conventions.h"
#include "errors.h"
#include "tensor_access.h"

namespace opmesh::common {

// The host arrays a sparse_flash_mla call's params point into; `given` tells an absent array
// from an empty one.
struct MlaHost {
  struct Array {
    std::vector<int64_t> values;
    bool given = false;
    int64_t columns = 0;  // block tables: entries per row
    const int64_t* data() const {
      static const int64_t kNone = 0;
      return !given ? nullptr : values.empty() ? &kNone : values.data();
    }
  };
  Array cu_q, cu_ori, cu_cmp, used_q, used_ori, used_cmp, residuals, ori_table, cmp_table;
};

template <class Ints>
MlaHost::Array mla_array(const std::optional<Ints>& ints) {
  MlaHost::Array a;
  a.given = ints.has_value();
  a.values = host_values(ints);
  a.columns = ints.has_value() ? HostIntsAccess<Ints>::columns(*ints) : 0;
  return a;
}

template <class Call>
MlaHost sparse_flash_mla_host(const Call& c) {
  return {
      mla_array(c.cu_seqlens_q),    mla_array(c.cu_seqlens_ori_kv), mla_array(c.cu_seqlens_cmp_kv),
      mla_array(c.seqused_q),       mla_array(c.seqused_ori_kv),    mla_array(c.seqused_cmp_kv),
      mla_array(c.cmp_residual_kv), mla_array(c.ori_block_table),   mla_array(c.cmp_block_table)};
}

// A per-sequence array of `batch` entries (cu_seqlens: batch + 1).
inline void check_entries(const MlaHost::Array& a, int64_t batch, const char* name) {
  if (a.given && static_cast<int64_t>(a.values.size()) != batch) {
    throw core::ArgumentError(name, "expected " + std::to_string(batch) + " entries, got " +
                                        std::to_string(a.values.size()));
  }
}

// One key tensor's sizes, lengths, block table and mask.
template <class Tensor>
void fill_mla_keys(core::MlaKeys& k, const std::optional<Tensor>& kv, const MlaHost::Array& cu,
                   const MlaHost::Array& used, const MlaHost::Array& table, core::Layout layout,
                   int64_t batch, const char* cu_name, const char* used_name) {
  k.present = kv.has_value();
  if (!k.present) return;
  const std::vector<int64_t> ks = sizes_of(*kv);
  const bool paged = layout == core::Layout::kPagedBBND;
  k.seq = paged ? 0 : ks[layout == core::Layout::kTND ? 0 : 1];
  check_entries(cu, batch + 1, cu_name);
  check_entries(used, batch, used_name);
  k.cu_seqlens = cu.data();
  k.seqused = used.data();
  if (paged) fill_paged(k, ks, table.data(), table.columns);
}

template <class Call>
core::SparseFlashMlaParams sparse_flash_mla_params(const Call& c, const MlaHost& h) {
  core::SparseFlashMlaParams p;
  c.copy_scalars_to(p);  // cmp_ratio
  p.layout_q = conventions::attention_layout(c.layout_q, "layout_q");
  p.layout_kv = conventions::attention_layout(c.layout_kv, "layout_kv");
  const bool tnd = p.layout_q == core::Layout::kTND;
  const std::vector<int64_t> qs = sizes_of(c.q);
  p.batch = tnd ? static_cast<int64_t>(h.cu_q.values.size()) - 1 : qs[0];
  if (tnd && !h.cu_q.given) throw core::ArgumentError("cu_seqlens_q", "is required for TND");
  p.batch = std::max<int64_t>(p.batch, 0);
  p.seq_q = qs[tnd ? 0 : 1];
  p.heads_q = qs[qs.size() - 2];
  p.head_dim = qs.back();
  const auto& any_kv = c.ori_kv.has_value() ? c.ori_kv : c.cmp_kv;
  p.heads_kv = any_kv.has_value() ? sizes_of(*any_kv)[sizes_of(*any_kv).size() - 2] : 1;
  check_entries(h.used_q, p.batch, "seqused_q");
  p.cu_seqlens_q = h.cu_q.data();
  p.seqused_q = h.used_q.data();
  fill_mla_keys(p.ori, c.ori_kv, h.cu_ori, h.used_ori, h.ori_table, p.layout_kv, p.batch,
                "cu_seqlens_ori_kv", "seqused_ori_kv");
  fill_mla_keys(p.cmp, c.cmp_kv, h.cu_cmp, h.used_cmp, h.cmp_table, p.layout_kv, p.batch,
                "cu_seqlens_cmp_kv", "seqused_cmp_kv");
  p.ori.mask_mode = static_cast<core::MaskMode>(c.ori_mask_mode);
  p.ori.win_left = c.ori_win_left;
  p.ori.win_right = c.ori_win_right;
  p.cmp.mask_mode = static_cast<core::MaskMode>(c.cmp_mask_mode);
  check_entries(h.residuals, p.batch, "cmp_residual_kv");
  p.cmp_residuals = h.residuals.data();
  if (c.topk_value_mode != 1) {
    throw core::ArgumentError("topk_value_mode", "must be 1 (indices are token positions), got " +
                                                     std::to_string(c.topk_value_mode));
  }
  p.scale = static_cast<float>(c.softmax_scale);
  p.dtype = dtype_of(c.q, "q");
  return p;
}

// Whether a call struct has ori_kv_scale (sparse_flash_mla's forward), in C++17 (the MindSpore
// binding's standard).
template <class Call, class = void>
struct HasMlaScales : std::false_type {};
template <class Call>
struct HasMlaScales<Call, std::void_t<decltype(std::declval<const Call&>().ori_kv_scale)>>
    : std::true_type {};

// The call's q, key tensors (with a quantized one's row scales), selections (int32), topk lengths
// (int32) and sinks (float32).
template <class Call>
void point_sparse_flash_mla(core::SparseFlashMlaParams& p, const Call& c) {
  const int qoff = p.layout_q == core::Layout::kTND ? -1 : 0;
  const int koff = p.layout_kv == core::Layout::kPagedBBND ? 0 : qoff;
  p.q = layout_view(c.q, qoff);
  if (c.ori_kv.has_value()) p.ori.kv = layout_view(*c.ori_kv, koff);
  if (c.cmp_kv.has_value()) p.cmp.kv = layout_view(*c.cmp_kv, koff);
  const auto selection = [&](core::MlaKeys& k, const auto& indices, const auto& lengths) {
    if (indices.has_value()) {
      k.indices = layout_view(*indices, qoff);
      k.topk = sizes_of(*indices).back();
    }
    if (lengths.has_value()) k.topk_length = layout_view(*lengths, qoff);
  };
  selection(p.ori, c.ori_sparse_indices, c.ori_topk_length);
  selection(p.cmp, c.cmp_sparse_indices, c.cmp_topk_length);
  if constexpr (HasMlaScales<Call>::value) {  // the forward: a quantized ori_kv or cmp_kv
    using Tensor = std::decay_t<decltype(c.q)>;
    for (auto [k, kv, scale] : {std::tuple{&p.ori, &c.ori_kv, &c.ori_kv_scale},
                                std::tuple{&p.cmp, &c.cmp_kv, &c.cmp_kv_scale}}) {
      if (!scale->has_value()) continue;
      k->format = TensorAccess<Tensor>::cache_format(**kv);
      k->scale = layout_view(**scale, koff);
    }
  }
  p.sinks = c.sinks.has_value() ? static_cast<const float*>(data_of(*c.sinks)) : nullptr;
}

// The backward's inputs (dout and attention_out in q's dtype, softmax_lse and dlse float32
// contiguous) and its outputs: dq, d ori_kv, d cmp_kv, dsinks (each only when the call has it).
template <class Call, class Tensor>
core::SparseFlashMlaGrads sparse_flash_mla_grads(const Call& c, bool tnd, const Tensor (&out)[4]) {
  auto mutable_data = [](const Tensor& t) { return const_cast<void*>(data_of(t)); };
  core::SparseFlashMlaGrads g;
  g.dout = layout_view(c.dout, tnd ? -1 : 0);
  g.out = layout_view(c.attention_out, tnd ? -1 : 0);
  g.softmax_lse = static_cast<const float*>(data_of(c.softmax_lse));
  g.dlse = c.dlse.has_value() ? static_cast<const float*>(data_of(*c.dlse)) : nullptr;
  g.dq = mutable_data(out[0]);
  g.d_ori_kv = c.ori_kv.has_value() ? mutable_data(out[1]) : nullptr;
  g.d_cmp_kv = c.cmp_kv.has_value() ? mutable_data(out[2]) : nullptr;
  g.dsinks = c.sinks.has_value() ? static_cast<float*>(mutable_data(out[3])) : nullptr;
  return g;
}

// A selection's topk lengths as host values, row by row ([rows][N2]; empty without them).
inline std::vector<int64_t> topk_length_values(const core::SparseFlashMlaParams& p,
                                               const core::MlaKeys& k) {
  std::vector<int64_t> out;
  if (k.topk_length.data == nullptr) return out;
  const bool tnd = p.layout_q == core::Layout::kTND;
  const int64_t outer = tnd ? 1 : p.batch;
  const int32_t* v = static_cast<const int32_t*>(k.topk_length.data);
  const core::View& st = k.topk_length;
  for (int64_t b = 0; b < outer; ++b) {
    for (int64_t s = 0; s < p.seq_q; ++s) {
      for (int64_t g = 0; g < p.heads_kv; ++g) out.push_back(v[b * st.sb + s * st.ss + g * st.sn]);
    }
  }
  return out;
}

// The call's plan: the metadata's words checked against the call (ArgumentError("metadata")
// naming what differs) and its workers' stretches as token tasks.
inline core::sparse::TokenSchedule planned_schedule(const core::SparseFlashMlaParams& p,
                                                    const std::vector<int64_t>& metadata) {
  namespace plan = core::mla_plan;
  core::validate(p);
  const std::vector<int32_t> words(metadata.begin(), metadata.end());
  const plan::Plan planned = plan::read(words.data(), static_cast<int64_t>(words.size()));
  const core::MlaSequences seqs = core::sparse_flash_mla_sequences(p);
  plan::Arrays arrays = plan::arrays_of(p);
  const std::vector<int64_t> ori = topk_length_values(p, p.ori), cmp = topk_length_values(p, p.cmp);
  for (const auto& [values, k] :
       {std::pair{&ori, plan::kOriTopkLength}, {&cmp, plan::kCmpTopkLength}}) {
    if (!values->empty()) {
      arrays.data[k] = values->data();
      arrays.count[k] = static_cast<int64_t>(values->size());
    }
  }
  int64_t rows = 0;
  for (const core::Sequence& s : seqs.ori) rows += s.q_len;
  plan::verify(planned, plan::config_of(p, seqs), arrays, rows);
  return plan::schedule(planned, seqs.ori);
}

// sparse_flash_mla_metadata's plan from its call.
template <class Call>
core::mla_plan::Plan sparse_flash_mla_metadata_plan(const Call& c, int64_t workers) {
  namespace plan = core::mla_plan;
  plan::Config cfg;
  c.copy_scalars_to(cfg);  // heads, sizes, top-k, ratio, masks, windows, presence
  cfg.layout_q = conventions::attention_layout(c.layout_q, "layout_q");
  cfg.layout_kv = conventions::attention_layout(c.layout_kv, "layout_kv");
  cfg.num_workers = workers;
  const std::vector<int64_t> values[plan::kArrays] = {
      host_values(c.cu_seqlens_q),      host_values(c.cu_seqlens_ori_kv),
      host_values(c.cu_seqlens_cmp_kv), host_values(c.seqused_q),
      host_values(c.seqused_ori_kv),    host_values(c.seqused_cmp_kv),
      host_values(c.cmp_residual_kv),   host_values(c.ori_topk_length),
      host_values(c.cmp_topk_length)};
  const bool given[plan::kArrays] = {
      c.cu_seqlens_q.has_value(),      c.cu_seqlens_ori_kv.has_value(),
      c.cu_seqlens_cmp_kv.has_value(), c.seqused_q.has_value(),
      c.seqused_ori_kv.has_value(),    c.seqused_cmp_kv.has_value(),
      c.cmp_residual_kv.has_value(),   c.ori_topk_length.has_value(),
      c.cmp_topk_length.has_value()};
  if (cfg.layout_q == core::Layout::kTND) {
    if (!given[plan::kCuQ] || values[plan::kCuQ].empty()) {
      throw core::ArgumentError("cu_seqlens_q", "is required for layout_q TND");
    }
    const int64_t batch = static_cast<int64_t>(values[plan::kCuQ].size()) - 1;
    if (cfg.batch_size != 0 && cfg.batch_size != batch) {
      throw core::ArgumentError("batch_size", "is " + std::to_string(cfg.batch_size) +
                                                  ", but cu_seqlens_q holds " +
                                                  std::to_string(batch) + " sequences");
    }
    cfg.batch_size = batch;
  }
  plan::Arrays arrays;
  static const int64_t kNone = 0;
  for (int k = 0; k < plan::kArrays; ++k) {
    if (!given[k]) continue;
    arrays.data[k] = values[k].empty() ? &kNone : values[k].data();
    arrays.count[k] = static_cast<int64_t>(values[k].size());
  }
  return plan::make_plan(cfg, arrays);
}

}  // namespace opmesh::common
