// sparse_flash_attention and its backward on MindSpore tensors: the shapes were checked by the
// shared torch shape functions in Python (sparse_indices arrive as int32, sinks as float32); the
// core checks the values and computes.
#include <memory>
#include <vector>

#include "attention/sparse_attention.h"
#include "conventions.h"
#include "cpu_features.h"
#include "ms_call.h"

namespace opmesh::ms_binding {
namespace {

struct Host {
  std::vector<int64_t> qlens, klens, table;
};

void strides4(const ms::Tensor& t, int off, int64_t* dst) {
  const std::vector<int64_t> s = strides_of(t);
  for (int i = 0; i < 4; ++i) {
    const int dim = i + off;
    dst[i] = dim >= 0 && dim < static_cast<int>(s.size()) ? s[dim] : 0;
  }
}

// The core's params of a call, without tensor pointers; `inputs` gets the tensors in the order
// point_at() reads them: query, key, value, sparse_indices, then the ropes and sinks when present.
template <class Call>
core::SparseAttentionParams base_params(const Call& c, const Host& host,
                                        std::vector<ms::Tensor>& inputs) {
  core::SparseAttentionParams p;
  p.layout_query =
      checked([&] { return conventions::indexer_layout(c.layout_query, "layout_query"); });
  p.layout_kv = checked([&] { return conventions::indexer_key_layout(c.layout_kv, "layout_kv"); });
  p.sparse_mode = checked([&] { return conventions::sparse_mode(c.sparse_mode); });
  p.pre_tokens = c.pre_tokens;
  p.next_tokens = c.next_tokens;
  const bool tnd = p.layout_query == core::Layout::kTND;
  const bool paged = p.layout_kv == core::Layout::kPagedBBND;
  require_rank(c.query, tnd ? 3 : 4, "query");
  require_rank(c.key, paged || !tnd ? 4 : 3, "key");
  require_rank(c.value, paged || !tnd ? 4 : 3, "value");
  require_rank(c.sparse_indices, tnd ? 3 : 4, "sparse_indices");
  const std::vector<int64_t> qs = c.query.shape();
  const std::vector<int64_t> ks = c.key.shape();
  const std::vector<int64_t> is = c.sparse_indices.shape();
  p.batch = tnd ? static_cast<int64_t>(host.qlens.size()) : qs[0];
  p.seq_q = qs[tnd ? 0 : 1];
  p.seq_k = paged ? 0 : ks[tnd ? 0 : 1];
  p.heads_q = qs[qs.size() - 2];
  p.head_dim = qs.back();
  p.heads_k = ks[ks.size() - 2];
  p.value_dim = c.value.shape().back();
  p.index_heads = is[is.size() - 2];
  p.sparse_count = is.back();
  p.sparse_block_size = c.sparse_block_size;
  p.scale = static_cast<float>(c.scale_value);
  p.dtype = core_dtype(c.query, "query");
  if (c.query_rope) p.rope_dim = c.query_rope->shape().back();
  p.seq_q_lens = host.qlens.empty() ? nullptr : host.qlens.data();
  p.seq_k_lens = host.klens.empty() ? nullptr : host.klens.data();
  if (paged) {
    p.block_table = host.table.data();
    p.max_blocks = c.block_table ? c.block_table->cols : 0;
    p.block_size = ks[1];
    p.block_count = ks[0];
  }
  inputs = {c.query, c.key, c.value, c.sparse_indices};
  if (c.query_rope) inputs.insert(inputs.end(), {*c.query_rope, *c.key_rope});
  if (c.sinks) inputs.push_back(*c.sinks);
  return p;
}

// Points p at the runner's inputs (ordered as base_params made them).
void point_at(core::SparseAttentionParams& p, const std::vector<ms::Tensor>& in, bool rope,
              bool sinks, const Host& host) {
  const int qoff = p.layout_query == core::Layout::kTND ? -1 : 0;
  const int koff = p.layout_kv == core::Layout::kPagedBBND ? 0 : qoff;
  p.query = in[0].GetDataPtr();
  strides4(in[0], qoff, p.query_stride);
  p.key = in[1].GetDataPtr();
  strides4(in[1], koff, p.key_stride);
  p.value = in[2].GetDataPtr();
  strides4(in[2], koff, p.value_stride);
  p.indices = static_cast<const int32_t*>(in[3].GetDataPtr());
  strides4(in[3], qoff, p.indices_stride);
  size_t next = 4;
  if (rope) {
    p.query_rope = in[next].GetDataPtr();
    strides4(in[next++], qoff, p.query_rope_stride);
    p.key_rope = in[next].GetDataPtr();
    strides4(in[next++], koff, p.key_rope_stride);
  }
  if (sinks) p.sinks = static_cast<const float*>(in[next].GetDataPtr());
  p.seq_q_lens = host.qlens.empty() ? nullptr : host.qlens.data();
  p.seq_k_lens = host.klens.empty() ? nullptr : host.klens.data();
  p.block_table = host.table.empty() ? nullptr : host.table.data();
}

template <class Call>
std::shared_ptr<Host> host_of(const Call& c) {
  auto h = std::make_shared<Host>();
  if (c.actual_seq_lengths_query) h->qlens = c.actual_seq_lengths_query->values;
  if (c.actual_seq_lengths_kv) h->klens = c.actual_seq_lengths_kv->values;
  if (c.block_table) h->table = c.block_table->values;
  return h;
}

template <class Call>
void resolve_all(const Call& c) {
  resolve({&c.query, &c.key, &c.value, &c.sparse_indices});
  resolve(c.query_rope);
  resolve(c.key_rope);
  resolve(c.sinks);
}

}  // namespace

py::object sparse_flash_attention(const SparseFlashAttentionCall& call) {
  resolve_all(call);
  auto host = host_of(call);
  std::vector<ms::Tensor> inputs;
  core::SparseAttentionParams base = base_params(call, *host, inputs);
  const bool no_heads = base.heads_q == 0 && base.heads_k == 0;
  {
    core::SparseAttentionParams p = base;
    p.seq_q_lens = host->qlens.empty() ? nullptr : host->qlens.data();
    p.seq_k_lens = host->klens.empty() ? nullptr : host->klens.data();
    p.block_table = host->table.empty() ? nullptr : host->table.data();
    if (no_heads) {
      p.heads_q = p.heads_k = p.index_heads = 1;
      p.sparse_count = 0;
      checked([&] {
        core::validate(p);
        return 0;
      });
    }
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
  const bool rope = call.query_rope.has_value();
  const bool sinks = call.sinks.has_value();
  return launch("OpmeshSparseFlashAttention", inputs, outs,
                [base, host, rope, sinks, lse, no_heads, tnd](const std::vector<ms::Tensor>& in,
                                                              std::vector<ms::Tensor>& out) {
                  if (no_heads) return;
                  core::SparseAttentionParams p = base;
                  point_at(p, in, rope, sinks, *host);
                  p.out = out[0].GetDataPtr();
                  strides4(out[0], tnd ? -1 : 0, p.out_stride);
                  if (lse) {
                    p.softmax_max = out[1].data_ptr<float>();
                    p.softmax_sum = out[2].data_ptr<float>();
                  }
                  checked([&] {
                    core::sparse_flash_attention(p, ThreadExecutor(), core::active_isa());
                    return 0;
                  });
                });
}

py::object sparse_flash_attention_backward(const SparseFlashAttentionBackwardCall& call) {
  resolve_all(call);
  resolve({&call.dout, &call.attention_out, &call.softmax_max, &call.softmax_sum});
  auto host = host_of(call);
  std::vector<ms::Tensor> inputs;
  core::SparseAttentionParams base = base_params(call, *host, inputs);
  const bool no_heads = base.heads_q == 0 && base.heads_k == 0;
  const size_t extra = inputs.size();
  inputs.insert(inputs.end(), {call.dout, call.attention_out, call.softmax_max, call.softmax_sum});
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
  return launch("OpmeshSparseFlashAttentionGrad", inputs, outs,
                [base, host, rope, sinks, no_heads, extra, tnd](const std::vector<ms::Tensor>& in,
                                                                std::vector<ms::Tensor>& out) {
                  if (no_heads) return;
                  core::SparseAttentionParams p = base;
                  point_at(p, in, rope, sinks, *host);
                  core::SparseAttentionGrads g;
                  g.dout = in[extra].GetDataPtr();
                  strides4(in[extra], tnd ? -1 : 0, g.dout_stride);
                  g.out = in[extra + 1].GetDataPtr();
                  strides4(in[extra + 1], tnd ? -1 : 0, g.out_stride);
                  g.softmax_max = static_cast<const float*>(in[extra + 2].GetDataPtr());
                  g.softmax_sum = static_cast<const float*>(in[extra + 3].GetDataPtr());
                  g.dq = out[0].GetDataPtr();
                  g.dk = out[1].GetDataPtr();
                  g.dv = out[2].GetDataPtr();
                  if (rope) {
                    g.dq_rope = out[3].GetDataPtr();
                    g.dk_rope = out[4].GetDataPtr();
                  }
                  if (sinks) g.dsinks = out[5].data_ptr<float>();
                  checked([&] {
                    core::sparse_flash_attention_backward(p, g, ThreadExecutor(),
                                                          core::active_isa());
                    return 0;
                  });
                });
}

}  // namespace opmesh::ms_binding
