// sparse_flash_attention and its backward on MindSpore tensors: the shapes were checked by the
// shared torch shape functions in Python (sparse_indices arrive as int32, sinks as float32); the
// core checks the values and computes.
#include <memory>
#include <vector>

#include "attention/sparse_attention.h"
#include "conventions.h"
#include "cpu_features.h"
#include "ms_call.h"
#include "sequence_params.h"

namespace opmesh::ms_binding {
namespace {

template <class Call>
void resolve_all(const Call& c) {
  resolve({&c.query, &c.key, &c.value, &c.sparse_indices});
  resolve(c.query_rope);
  resolve(c.key_rope);
  resolve(c.sinks);
}

// The core's params of a call, without tensor pointers (added in the runner), and the host
// arrays they point into.
template <class Call>
core::SparseAttentionParams base_params(const Call& c, std::shared_ptr<common::HostArrays>& host) {
  resolve_all(c);
  const bool tnd = checked([&] {
                     return conventions::indexer_layout(c.layout_query, "layout_query");
                   }) == core::Layout::kTND;
  const bool paged = checked([&] {
                       return conventions::indexer_key_layout(c.layout_kv, "layout_kv");
                     }) == core::Layout::kPagedBBND;
  require_rank(c.query, tnd ? 3 : 4, "query");
  require_rank(c.key, paged || !tnd ? 4 : 3, "key");
  require_rank(c.value, paged || !tnd ? 4 : 3, "value");
  require_rank(c.sparse_indices, tnd ? 3 : 4, "sparse_indices");
  host = std::make_shared<common::HostArrays>(
      common::host_arrays(c.actual_seq_lengths_query, c.actual_seq_lengths_kv, c.block_table));
  return checked([&] { return common::sparse_attention_params(c, *host); });
}

}  // namespace

py::object sparse_flash_attention(const SparseFlashAttentionCall& call) {
  std::shared_ptr<common::HostArrays> host;
  const core::SparseAttentionParams base = base_params(call, host);
  const bool no_heads = base.heads_q == 0 && base.heads_k == 0;
  if (no_heads) {
    // No rows to read: the lengths, table and band are still checked as with heads.
    core::SparseAttentionParams p = base;
    p.heads_q = p.heads_k = p.index_heads = 1;
    p.sparse_count = 0;
    checked([&] {
      core::validate(p);
      return 0;
    });
  }
  std::vector<int64_t> out_shape = call.query.shape();
  out_shape.back() = base.value_dim;
  const bool tnd = base.layout_query == core::Layout::kTND;
  const int64_t g = base.heads_k > 0 ? base.heads_q / base.heads_k : 0;
  std::vector<int64_t> stats = tnd ? std::vector<int64_t>{base.heads_k, base.seq_q, g}
                                   : std::vector<int64_t>{base.batch, base.heads_k, base.seq_q, g};
  const bool lse = call.return_softmax_lse;
  if (!lse) stats = {0};
  const std::vector<OutputSpec> outs{{call.query.data_type(), out_shape},
                                     {mindspore::kNumberTypeFloat32, stats},
                                     {mindspore::kNumberTypeFloat32, stats}};
  return launch("OpmeshSparseFlashAttention", inputs_of(call), outs,
                [call, base, host, lse, no_heads, tnd](const std::vector<ms::Tensor>& in,
                                                       std::vector<ms::Tensor>& out) {
                  if (no_heads) return;
                  core::SparseAttentionParams p = base;
                  common::point_sparse_attention(p, with_inputs(call, in));
                  p.out = common::mutable_layout_view(out[0], tnd ? -1 : 0);
                  if (lse) {
                    p.softmax_max = out[1].data_ptr<float>();
                    p.softmax_sum = out[2].data_ptr<float>();
                  }
                  checked([&] {
                    cpu_kernels().sparse_flash_attention(p, ThreadExecutor());
                    return 0;
                  });
                });
}

py::object sparse_flash_attention_backward(const SparseFlashAttentionBackwardCall& call) {
  resolve({&call.dout, &call.attention_out, &call.softmax_max, &call.softmax_sum});
  std::shared_ptr<common::HostArrays> host;
  const core::SparseAttentionParams base = base_params(call, host);
  const bool no_heads = base.heads_q == 0 && base.heads_k == 0;
  const bool rope = call.query_rope.has_value();
  const bool sinks = call.sinks.has_value();
  const auto dtype = call.query.data_type();
  std::vector<OutputSpec> outs{
      {dtype, call.query.shape()},
      {dtype, call.key.shape()},
      {dtype, call.value.shape()},
      {dtype, rope ? call.query_rope->shape() : std::vector<int64_t>{0}},
      {dtype, rope ? call.key_rope->shape() : std::vector<int64_t>{0}},
      {mindspore::kNumberTypeFloat32,
       sinks ? std::vector<int64_t>{base.heads_q} : std::vector<int64_t>{0}}};
  const bool tnd = base.layout_query == core::Layout::kTND;
  return launch("OpmeshSparseFlashAttentionGrad", inputs_of(call), outs,
                [call, base, host, no_heads, tnd](const std::vector<ms::Tensor>& in,
                                                  std::vector<ms::Tensor>& out) {
                  if (no_heads) return;
                  const SparseFlashAttentionBackwardCall c = with_inputs(call, in);
                  core::SparseAttentionParams p = base;
                  common::point_sparse_attention(p, c);
                  const ms::Tensor grads[6] = {out[0], out[1], out[2], out[3], out[4], out[5]};
                  const core::SparseAttentionGrads g =
                      common::sparse_attention_grads(c, tnd, grads);
                  checked([&] {
                    cpu_kernels().sparse_flash_attention_backward(p, g, ThreadExecutor());
                    return 0;
                  });
                });
}

}  // namespace opmesh::ms_binding
