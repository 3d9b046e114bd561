// The core's params of the sequence operators (the lightning indexer and its KL losses, the
// sparse stage), from a checked call struct of any binding (its tensors read through
// tensor_access.h). Each comes in two steps, since a binding may know its tensors' memory only
// when the kernel runs (MindSpore's runner): `*_params(call, host)` fills the layouts, mask,
// sizes, options and host arrays; `point_*(params, call)` adds the tensors' pointers and strides.
// Layout and mask arguments are parsed again (the bindings checked them: nothing throws here
// that the checks would not have thrown first).
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention/sparse_attention.h"
#include "conventions.h"
#include "errors.h"
#include "indexer/indexer.h"
#include "indexer/indexer_kl_loss.h"
#include "indexer/lightning_indexer.h"
#include "indexer/sparse_kl_loss.h"
#include "tensor_access.h"

namespace opmesh::common {

// ------------------------------------------------------------ dense_lightning_indexer_softmax_lse

// ----------------------------------------------------------------------------- compressed keys

// A call's host arrays with its compressed keys' residuals (cmp_residual_key).
template <class Call>
HostArrays with_residuals(HostArrays h, const Call& c) {
  h.residuals_given = c.cmp_residual_key.has_value();
  h.residuals = host_values(c.cmp_residual_key);
  return h;
}

// The residuals into the params (core::Compression), one per sequence.
inline void point_residuals(core::Compression& p, int64_t batch, const HostArrays& h) {
  if (!h.residuals_given) return;
  if (static_cast<int64_t>(h.residuals.size()) != batch) {
    throw core::ArgumentError("cmp_residual_key", "expected " + std::to_string(batch) +
                                                      " entries (one per sequence), got " +
                                                      std::to_string(h.residuals.size()));
  }
  static const int64_t kNoSequences = 0;
  p.cmp_residuals = h.residuals.empty() ? &kNoSequences : h.residuals.data();
}

// The indexer family's host arrays (dense statistics and both KL losses): the lengths and the
// residuals.
template <class Call>
HostArrays indexer_host(const Call& c) {
  return with_residuals(host_arrays(c.actual_seq_qlen, c.actual_seq_klen), c);
}

// The indexer family's layout, mask (pre_tokens and next_tokens come by name), sequence sizes
// and lengths, read off the index tensors: what the indexer and its KL losses share.
template <class Params, class Call>
void indexer_sequences_of(Params& p, const Call& c, const HostArrays& h) {
  c.copy_scalars_to(p);
  p.layout = conventions::indexer_layout(c.layout);
  p.sparse_mode = conventions::sparse_mode(c.sparse_mode);
  const bool tnd = p.layout == core::Layout::kTND;
  const std::vector<int64_t> qi = sizes_of(c.query_index), ki = sizes_of(c.key_index);
  p.batch = tnd ? static_cast<int64_t>(h.q_lens.size()) : qi[0];
  p.seq_q = qi[tnd ? 0 : 1];
  p.seq_k = ki[tnd ? 0 : 1];
  p.seq_q_lens = h.q();
  p.seq_k_lens = h.k();
  point_residuals(p, p.batch, h);
}

template <class Call>
core::IndexerParams indexer_params(const Call& c, const HostArrays& h) {
  core::IndexerParams p;
  indexer_sequences_of(p, c, h);
  const std::vector<int64_t> qs = sizes_of(c.query_index), ks = sizes_of(c.key_index);
  p.heads_q = qs[qs.size() - 2];
  p.heads_k = ks[ks.size() - 2];
  p.head_dim = qs.back();
  p.qk_dtype = dtype_of(c.query_index, "query_index");
  p.weights_dtype = dtype_of(c.weights, "weights");
  return p;
}

// The indexer's inputs: query_index, key_index and weights.
template <class Call>
void point_indexer(core::IndexerParams& p, const Call& c) {
  const int off = p.layout == core::Layout::kTND ? -1 : 0;
  p.query = layout_view(c.query_index, off);
  p.key = layout_view(c.key_index, off);
  p.weights = layout_view(c.weights, off);
}

// ------------------------------------------------------------------ the sparse stage's base

// The QueryKeyLayout base of a sparse-stage call (lightning_indexer, sparse_flash_attention)
// whose keys are in layout `key`.
template <class Call>
void fill_query_key_layout(core::QueryKeyLayout& p, const Call& c, core::Layout key,
                           const HostArrays& h) {
  p.layout_query = conventions::indexer_layout(c.layout_query, "layout_query");
  p.sparse_mode = conventions::sparse_mode(c.sparse_mode);  // pre_tokens, next_tokens: by name
  const bool tnd = p.layout_query == core::Layout::kTND;
  const bool paged = key == core::Layout::kPagedBBND;
  const std::vector<int64_t> qs = sizes_of(c.query), ks = sizes_of(c.key);
  p.batch = tnd ? static_cast<int64_t>(h.q_lens.size()) : qs[0];
  p.seq_q = qs[tnd ? 0 : 1];
  p.seq_k = paged ? 0 : ks[tnd ? 0 : 1];
  p.heads_q = qs[qs.size() - 2];
  p.heads_k = ks[ks.size() - 2];
  p.head_dim = qs.back();
  p.seq_q_lens = h.q();
  p.seq_k_lens = h.k();
  if (paged) fill_paged(p, ks, h.blocks(), h.table_columns);
}

// The query's and key's pointers and strides of a sparse-stage call, keys in layout `key`.
template <class Params, class Call>
void point_query_key(Params& p, const Call& c, core::Layout key) {
  const int qoff = p.layout_query == core::Layout::kTND ? -1 : 0;
  const int koff = key == core::Layout::kPagedBBND ? 0 : qoff;
  p.query = layout_view(c.query, qoff);
  p.key = layout_view(c.key, koff);
}

// --------------------------------------------------------------------------- lightning_indexer

template <class Call>
core::LightningIndexerParams lightning_indexer_params(const Call& c, const HostArrays& h) {
  core::LightningIndexerParams p;
  c.copy_scalars_to(p);  // sparse_count, cmp_ratio, ...
  p.layout_key = conventions::indexer_key_layout(c.layout_key);
  fill_query_key_layout(p, c, p.layout_key, h);
  p.qk_dtype = dtype_of(c.query, "query");
  p.weights_dtype = dtype_of(c.weights, "weights");
  point_residuals(p, p.batch, h);
  return p;
}

// lightning_indexer's host arrays: the lengths, the block table and the compressed keys'
// residuals.
template <class Call>
HostArrays lightning_indexer_host(const Call& c) {
  return with_residuals(
      host_arrays(c.actual_seq_lengths_query, c.actual_seq_lengths_key, c.block_table), c);
}

// lightning_indexer's inputs: query, key and weights.
template <class Call>
void point_lightning_indexer(core::LightningIndexerParams& p, const Call& c) {
  point_query_key(p, c, p.layout_key);
  p.weights = layout_view(c.weights, p.layout_query == core::Layout::kTND ? -1 : 0);
}

// ---------------------------------------------------- sparse_flash_attention and its backward

template <class Call>
core::SparseAttentionParams sparse_attention_params(const Call& c, const HostArrays& h) {
  core::SparseAttentionParams p;
  c.copy_scalars_to(p);  // sparse_block_size, ...
  p.layout_kv = conventions::indexer_key_layout(c.layout_kv, "layout_kv");
  fill_query_key_layout(p, c, p.layout_kv, h);
  const std::vector<int64_t> is = sizes_of(c.sparse_indices);
  p.value_dim = sizes_of(c.value).back();
  p.index_heads = is[is.size() - 2];
  p.sparse_count = is.back();
  p.rope_dim = c.query_rope.has_value() ? sizes_of(*c.query_rope).back() : 0;
  p.scale = static_cast<float>(c.scale_value);
  p.dtype = dtype_of(c.query, "query");
  return p;
}

// Whether a call struct has key_scale (sparse_flash_attention's forward), in C++17 (the
// MindSpore binding's standard).
template <class Call, class = void>
struct HasKeyScale : std::false_type {};
template <class Call>
struct HasKeyScale<Call, std::void_t<decltype(std::declval<const Call&>().key_scale)>>
    : std::true_type {};

// The call's query, key, value, sparse_indices (int32), ropes and sinks (float32, contiguous).
template <class Call>
void point_sparse_attention(core::SparseAttentionParams& p, const Call& c) {
  point_query_key(p, c, p.layout_kv);
  const int qoff = p.layout_query == core::Layout::kTND ? -1 : 0;
  const int koff = p.layout_kv == core::Layout::kPagedBBND ? 0 : qoff;
  p.value = layout_view(c.value, koff);
  if (c.query_rope.has_value()) {
    p.query_rope = layout_view(*c.query_rope, qoff);
    p.key_rope = layout_view(*c.key_rope, koff);
  }
  p.indices = layout_view(c.sparse_indices, qoff);
  p.sinks = c.sinks.has_value() ? static_cast<const float*>(data_of(*c.sinks)) : nullptr;
  if constexpr (HasKeyScale<Call>::value) {  // the forward: a quantized key and value
    if (c.key_scale.has_value()) {
      using Tensor = std::decay_t<decltype(c.key)>;
      p.kv_format = TensorAccess<Tensor>::cache_format(c.key);
      p.key_scale = layout_view(*c.key_scale, koff);
      p.value_scale = layout_view(*c.value_scale, koff);
    }
  }
}

// The backward's inputs (dout and attention_out in query's dtype, the statistics float32
// contiguous) and its outputs: dq, dk, dv, dq_rope, dk_rope, dsinks (the ropes' and the sinks'
// only when the call has them).
template <class Call, class Tensor>
core::SparseAttentionGrads sparse_attention_grads(const Call& c, bool tnd, const Tensor (&out)[6]) {
  auto mutable_data = [](const Tensor& t) { return const_cast<void*>(data_of(t)); };
  core::SparseAttentionGrads g;
  g.dout = layout_view(c.dout, tnd ? -1 : 0);
  g.out = layout_view(c.attention_out, tnd ? -1 : 0);
  g.softmax_max = static_cast<const float*>(data_of(c.softmax_max));
  g.softmax_sum = static_cast<const float*>(data_of(c.softmax_sum));
  g.dq = mutable_data(out[0]);
  g.dk = mutable_data(out[1]);
  g.dv = mutable_data(out[2]);
  if (c.query_rope.has_value()) {
    g.dq_rope = mutable_data(out[3]);
    g.dk_rope = mutable_data(out[4]);
  }
  g.dsinks = c.sinks.has_value() ? static_cast<float*>(mutable_data(out[5])) : nullptr;
  return g;
}

// ------------------------------------------------ the dense and the sparse indexer KL losses

// Whether Call is the dense loss's (which takes the indexer's statistics) rather than the sparse
// loss's (which takes a selection).
template <class Call, class = void>
inline constexpr bool kHasIndexStatistics = false;
template <class Call>
inline constexpr bool kHasIndexStatistics<
    Call, std::void_t<decltype(std::declval<const Call&>().softmax_max_index)>> = true;

template <class Call>
core::IndexerKlLossParams kl_loss_params(const Call& c, const HostArrays& h) {
  core::IndexerKlLossParams p;
  indexer_sequences_of(p, c, h);
  const std::vector<int64_t> qs = sizes_of(c.query), ks = sizes_of(c.key);
  const std::vector<int64_t> qi = sizes_of(c.query_index), ki = sizes_of(c.key_index);
  p.heads_q = qs[qs.size() - 2];
  p.heads_k = ks[ks.size() - 2];
  p.head_dim = qs.back();
  p.rope_dim = c.query_rope.has_value() ? sizes_of(*c.query_rope).back() : 0;
  p.index_heads_q = qi[qi.size() - 2];
  p.index_heads_k = ki[ki.size() - 2];
  p.index_dim = qi.back();
  p.scale = static_cast<float>(c.scale_value);
  return p;
}

template <class Tensor>
core::KlOperand kl_operand(const Tensor& t, bool tnd, const char* argument) {
  return core::KlOperand{layout_view(t, tnd ? -1 : 0), dtype_of(t, argument)};
}

template <class Tensor>
core::KlGradient kl_gradient(const Tensor& t, bool tnd, const char* argument) {
  return core::KlGradient{mutable_layout_view(t, tnd ? -1 : 0), dtype_of(t, argument)};
}

// The losses' inputs (the statistics float32 contiguous; the dense loss's index statistics too)
// and outputs: gradients shaped like query_index, key_index and weights, and the loss (float32).
template <class Call, class Tensor>
void point_kl_loss(core::IndexerKlLossParams& p, const Call& c, const Tensor (&out)[4]) {
  const bool tnd = p.layout == core::Layout::kTND;
  p.query = kl_operand(c.query, tnd, "query");
  p.key = kl_operand(c.key, tnd, "key");
  if (c.query_rope.has_value()) {
    p.query_rope = kl_operand(*c.query_rope, tnd, "query_rope");
    p.key_rope = kl_operand(*c.key_rope, tnd, "key_rope");
  }
  p.query_index = kl_operand(c.query_index, tnd, "query_index");
  p.key_index = kl_operand(c.key_index, tnd, "key_index");
  p.weights = kl_operand(c.weights, tnd, "weights");
  p.softmax_max = static_cast<const float*>(data_of(c.softmax_max));
  p.softmax_sum = static_cast<const float*>(data_of(c.softmax_sum));
  if constexpr (kHasIndexStatistics<Call>) {
    p.softmax_max_index = static_cast<const float*>(data_of(c.softmax_max_index));
    p.softmax_sum_index = static_cast<const float*>(data_of(c.softmax_sum_index));
  }
  p.d_query_index = kl_gradient(out[0], tnd, "query_index");
  p.d_key_index = kl_gradient(out[1], tnd, "key_index");
  p.d_weights = kl_gradient(out[2], tnd, "weights");
  p.loss = static_cast<float*>(const_cast<void*>(data_of(out[3])));
}

// The sparse loss: the dense loss's params and the call's selection (sparse_indices, int32).
template <class Call>
core::SparseKlLossParams sparse_kl_loss_params(const core::IndexerKlLossParams& dense,
                                               const Call& c) {
  core::SparseKlLossParams p;
  p.dense = dense;
  p.indices = layout_view(c.sparse_indices, dense.layout == core::Layout::kTND ? -1 : 0);
  const std::vector<int64_t> is = sizes_of(c.sparse_indices);
  p.index_heads = is[is.size() - 2];
  p.sparse_count = is.back();
  return p;
}

}  // namespace opmesh::common
