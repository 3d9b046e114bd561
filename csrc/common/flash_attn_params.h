// flash_attn's and flash_attn_backward's core params pointed at a call's tensors, written once for
// every binding over its tensor-access trait (tensor_access.h): the core's views of q, k, v (and
// the backward's out and dout), the lse's strides, the paged block table, the sinks, the score
// modifications, the scale, and every numeric option the params name as the schema does
// (copy_scalars_to). The binding hands a call that passed its checks and whose sinks, lse, dlse
// and alibi_slopes are float32 and contiguous, as the core reads them.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "attention/flash_attn.h"
#include "attention/flash_attn_backward.h"
#include "flash_attn_calls.h"
#include "tensor_access.h"

namespace opmesh::common {

namespace attn = core::attention;

// Positions of the batch, sequence, head and dim axes of a q/k/v-like tensor in `layout` (-1:
// absent). Paged caches read as [block][slot][head][dim].
struct AttentionAxes {
  int b, s, n, d;
};

inline AttentionAxes attention_axes(attn::Layout layout) {
  switch (layout) {
    case attn::Layout::kBNSD:
      return {0, 2, 1, 3};
    case attn::Layout::kTND:
      return {-1, 0, 1, 2};
    default:
      return {0, 1, 2, 3};
  }
}

// The core's [batch][sequence][head][dim] view of a tensor in `layout`; without `dim`, of a
// tensor shaped as one in `layout` without its last (head-dim) axis (sd 0).
template <class Tensor>
core::View attention_view(const Tensor& t, attn::Layout layout, bool dim = true) {
  const AttentionAxes a = attention_axes(layout);
  const std::vector<int64_t> st = TensorAccess<Tensor>::strides(t);
  core::View v;
  v.data = data_of(t);
  v.sb = a.b >= 0 ? st[a.b] : 0;
  v.ss = st[a.s];
  v.sn = st[a.n];
  v.sd = dim ? st[a.d] : 0;
  return v;
}

// The same view of an output the kernel writes.
template <class Tensor>
core::MutableView mutable_attention_view(const Tensor& t, attn::Layout layout) {
  return core::writable(attention_view(t, layout));
}

// An lse's strides for (batch, head, position): [B, N, S], or [N, T] for TND (no batch).
struct LseStrides {
  int64_t sb = 0, sn = 0, ss = 0;
};

template <class Tensor>
LseStrides lse_strides(const Tensor& t, bool tnd) {
  const std::vector<int64_t> st = TensorAccess<Tensor>::strides(t);
  return tnd ? LseStrides{0, st[0], st[1]} : LseStrides{st[0], st[1], st[2]};
}

// The scale (the given one, or 1 / sqrt(head_dim)), the ALiBi slopes and every numeric option
// the params name as the schema does (softcap, ...).
template <class Params, class Call>
void point_score_mods(Params& p, const Call& c) {
  c.copy_scalars_to(p);
  const double scale =
      c.softmax_scale.value_or(1.0 / std::sqrt(static_cast<double>(p.config.head_dim)));
  p.softmax_scale = static_cast<float>(scale);
  if (c.alibi_slopes.has_value()) {
    p.alibi_slopes = static_cast<const float*>(data_of(*c.alibi_slopes));
    const std::vector<int64_t> sizes = sizes_of(*c.alibi_slopes);
    p.alibi_sb = sizes.size() == 2 ? sizes[1] : 0;
  }
  if (c.sinks.has_value()) p.sinks = static_cast<const float*>(data_of(*c.sinks));
}

// The shapes the call's preparation reads off q and k (the paged block table's are the binding's:
// it decides where the table lives).
template <class Tensor>
calls::FlashAttnShapes flash_attn_shapes(const Tensor& q, const Tensor& k,
                                         const attn::PlanConfig& c) {
  const std::vector<int64_t> qs = sizes_of(q), ks = sizes_of(k);
  calls::FlashAttnShapes s;
  s.q_tnd = c.layout_q == attn::Layout::kTND;
  s.kv_tnd = c.layout_kv == attn::Layout::kTND;
  s.paged = c.layout_kv == attn::Layout::kPagedBBND;
  s.q_tokens = s.q_tnd ? qs[0] : 0;
  s.kv_tokens = s.kv_tnd ? ks[0] : 0;
  s.q_seq = s.q_tnd ? 0 : qs[attention_axes(c.layout_q).s];
  s.kv_seq = (!s.kv_tnd && !s.paged) ? ks[attention_axes(c.layout_kv).s] : 0;
  if (s.paged) {
    s.num_blocks = ks[0];
    s.block_size = ks[1];
  }
  return s;
}

// flash_attn's output shapes for a prepared call: attn_out in layout_out ([T, Nq, Dv] for TND)
// and the lse ([B, Nq, S1] / [Nq, T], or [0] when not asked for).
struct FlashAttnOutputShapes {
  std::vector<int64_t> out, lse;
};

template <class Tensor>
FlashAttnOutputShapes flash_attn_output_shapes(const Tensor& q, const attn::PlanConfig& c,
                                               bool return_lse) {
  const std::vector<int64_t> qs = sizes_of(q);
  const int64_t nq = c.num_heads_q;
  FlashAttnOutputShapes s;
  if (c.layout_q == attn::Layout::kTND) {
    s.out = {qs[0], nq, c.head_dim_v};
    s.lse = {nq, qs[0]};
  } else {
    const int64_t s1 = qs[attention_axes(c.layout_q).s];
    s.out = c.layout_out == attn::Layout::kBNSD
                ? std::vector<int64_t>{c.batch_size, nq, s1, c.head_dim_v}
                : std::vector<int64_t>{c.batch_size, s1, nq, c.head_dim_v};
    s.lse = {c.batch_size, nq, s1};
  }
  if (!return_lse) s.lse = {0};
  return s;
}

// flash_attn's params for a prepared call (`config`: the prepared configuration, `lengths` and
// `shapes` the host arrays and shapes it was prepared with), writing `out` and, when given, `lse`.
template <class Call, class Tensor>
attn::FlashAttnParams flash_attn_params(const Call& c, const attn::PlanConfig& config,
                                        const attn::LengthArrays& lengths,
                                        const calls::FlashAttnShapes& shapes, const Tensor& out,
                                        const Tensor* lse) {
  attn::FlashAttnParams p;
  p.config = config;
  p.lengths = lengths;
  p.dtype = dtype_of(c.q, "q");
  p.q = attention_view(c.q, config.layout_q);
  p.k = attention_view(c.k, config.layout_kv);
  p.v = attention_view(c.v, config.layout_kv);
  if (shapes.paged) {
    p.block_table = shapes.table;
    p.bt_sb = shapes.table_stride_b;
    p.bt_sj = shapes.table_stride_j;
    p.block_size = shapes.block_size;
  }
  point_score_mods(p, c);
  if (c.k_scale.has_value()) {
    p.kv_format = TensorAccess<Tensor>::cache_format(c.k);
    // (The scales: shaped as k and v without the head dim, d the last axis in every layout.)
    p.k_scale = attention_view(*c.k_scale, config.layout_kv, false);
    p.v_scale = attention_view(*c.v_scale, config.layout_kv, false);
  }
  p.out = mutable_attention_view(out, shapes.q_tnd ? attn::Layout::kTND : config.layout_out);
  if (lse != nullptr) {
    const LseStrides ls = lse_strides(*lse, shapes.q_tnd);
    p.lse = static_cast<float*>(const_cast<void*>(data_of(*lse)));
    p.lse_sb = ls.sb;
    p.lse_sn = ls.sn;
    p.lse_ss = ls.ss;
  }
  return p;
}

// flash_attn_backward's params for a prepared call, writing `grads` (dq, dk, dv, dsinks; the
// last read only when the call has sinks).
template <class Call, class Tensor>
attn::FlashAttnBackwardParams flash_attn_backward_params(const Call& c,
                                                         const attn::PlanConfig& config, bool q_tnd,
                                                         const Tensor (&grads)[4]) {
  attn::FlashAttnBackwardParams p;
  p.config = config;
  p.dtype = dtype_of(c.q, "q");
  p.q = attention_view(c.q, config.layout_q);
  p.k = attention_view(c.k, config.layout_kv);
  p.v = attention_view(c.v, config.layout_kv);
  p.out = attention_view(c.out, config.layout_out);
  p.dout = attention_view(c.dout, config.layout_out);
  const LseStrides ls = lse_strides(c.lse, q_tnd);
  p.lse = static_cast<const float*>(data_of(c.lse));
  p.lse_sb = ls.sb;
  p.lse_sn = ls.sn;
  p.lse_ss = ls.ss;
  if (c.dlse.has_value()) {
    p.dlse = static_cast<const float*>(data_of(*c.dlse));
    p.dlse_sb = ls.sb;
    p.dlse_sn = ls.sn;
    p.dlse_ss = ls.ss;
  }
  point_score_mods(p, c);
  if (c.sinks.has_value()) p.dsinks = static_cast<float*>(const_cast<void*>(data_of(grads[3])));
  p.dq = mutable_attention_view(grads[0], config.layout_q);
  p.dk = mutable_attention_view(grads[1], config.layout_kv);
  p.dv = mutable_attention_view(grads[2], config.layout_kv);
  return p;
}

}  // namespace opmesh::common
