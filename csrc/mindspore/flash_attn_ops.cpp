// flash_attn_metadata, flash_attn and its backward on MindSpore tensors. The checks that read
// lengths, block tables and plans, and the planning itself, are the torch binding's
// (csrc/common/flash_attn_calls.h); the arguments' conventions are read by
// csrc/common/conventions.h.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attention/flash_attn.h"
#include "attention/flash_attn_backward.h"
#include "conventions.h"
#include "cpu_features.h"
#include "flash_attn_calls.h"
#include "flash_attn_params.h"
#include "ms_call.h"

namespace opmesh::ms_binding {
namespace {

namespace attn = core::attention;

using Axes = common::AttentionAxes;
Axes axes_of(attn::Layout layout) { return common::attention_axes(layout); }

// Host int32 copies of the length arrays, owned together so a kernel closure can keep them.
struct HostLengths {
  std::vector<int32_t> cq, ck, uq, uk;
  bool given[4] = {false, false, false, false};
  attn::LengthArrays arrays() const {
    return {given[0] ? cq.data() : nullptr, given[1] ? ck.data() : nullptr,
            given[2] ? uq.data() : nullptr, given[3] ? uk.data() : nullptr};
  }
};

template <class Call>
std::shared_ptr<HostLengths> host_lengths(const Call& c) {
  auto l = std::make_shared<HostLengths>();
  const std::optional<HostInts>* lists[4] = {&c.cu_seqlens_q, &c.cu_seqlens_kv, &c.seqused_q,
                                             &c.seqused_kv};
  std::vector<int32_t>* copies[4] = {&l->cq, &l->ck, &l->uq, &l->uk};
  for (int i = 0; i < 4; ++i) {
    l->given[i] = lists[i]->has_value();
    *copies[i] = as_int32(values_of(*lists[i]));
  }
  return l;
}

// The layouts and mask of a call, in the core's words.
template <class Call>
attn::PlanConfig parsed_config(const Call& call) {
  return checked([&] {
    attn::PlanConfig c;
    c.layout_q = conventions::attention_layout(call.layout_q, "layout_q");
    c.layout_kv = conventions::attention_layout(call.layout_kv, "layout_kv");
    c.layout_out = conventions::attention_layout(call.layout_out, "layout_out");
    const core::Mask mask =
        conventions::attention_mask(call.mask_mode, call.win_left, call.win_right);
    c.mask_mode = mask.mode;
    c.win_left = mask.left;
    c.win_right = mask.right;
    return c;
  });
}

// The block table's row length (forward only: the backward has no paged keys).
int64_t blocks_per_seq(const FlashAttnCall& c) {
  return c.block_table.has_value() ? c.block_table->cols : 0;
}
int64_t blocks_per_seq(const FlashAttnBackwardCall&) { return 0; }
IntList block_table_of(const FlashAttnCall& c) { return values_of(c.block_table); }
IntList block_table_of(const FlashAttnBackwardCall&) { return std::nullopt; }

// The call's batch, after the guards that keep the binding within its tensors' shapes and its
// host arrays' ends (the shared checks have normally refused such calls already).
template <class Call>
int64_t checked_batch(const Call& call, const attn::PlanConfig& parsed) {
  const attn::Layout lq = parsed.layout_q, lkv = parsed.layout_kv;
  require_rank(call.q, lq == attn::Layout::kTND ? 3 : 4, "q");
  require_rank(call.k, lkv == attn::Layout::kTND ? 3 : 4, "k");
  require_rank(call.v, lkv == attn::Layout::kTND ? 3 : 4, "v");
  const IntList cu_q = values_of(call.cu_seqlens_q);
  int64_t batch = call.q.shape()[0];
  if (lq == attn::Layout::kTND) {
    if (!cu_q.has_value() || cu_q->empty()) value_error("cu_seqlens_q: required for layout TND");
    batch = static_cast<int64_t>(cu_q->size()) - 1;
  }
  if (lkv == attn::Layout::kTND && !call.cu_seqlens_kv.has_value()) {
    value_error("cu_seqlens_kv: required for layout TND");
  }
  require_entries(cu_q, batch + 1, "cu_seqlens_q");
  require_entries(values_of(call.cu_seqlens_kv), batch + 1, "cu_seqlens_kv");
  require_entries(values_of(call.seqused_q), batch, "seqused_q");
  require_entries(values_of(call.seqused_kv), batch, "seqused_kv");
  if (lkv == attn::Layout::kPagedBBND) {
    if (!call.seqused_kv.has_value()) {
      value_error("seqused_kv: required for paged keys and values");
    }
    require_entries(block_table_of(call), batch * blocks_per_seq(call), "block_table");
  }
  return batch;
}

// The call's configuration: its conventions parsed once, heads and dims from the tensors, and the
// checked batch.
template <class Call>
attn::PlanConfig base_config(const Call& call) {
  attn::PlanConfig c = parsed_config(call);
  c.batch_size = checked_batch(call, c);
  const Axes qa = axes_of(c.layout_q), ka = axes_of(c.layout_kv);
  c.num_heads_q = call.q.shape()[qa.n];
  c.num_heads_kv = call.k.shape()[ka.n];
  c.head_dim = call.q.shape()[qa.d];
  c.head_dim_v = call.v.shape()[ka.d];
  return c;
}

// A configuration with no heads checked as one with heads (lengths, masks, sizes).
attn::PlanConfig with_heads(attn::PlanConfig c) {
  if (c.num_heads_q == 0 && c.num_heads_kv == 0) c.num_heads_q = c.num_heads_kv = 1;
  return c;
}

calls::PlanWords plan_words_of(const std::vector<int32_t>& words, const IntList& given) {
  if (!given.has_value()) return {};
  return {words.data(), static_cast<int64_t>(words.size())};
}

void fill(ms::Tensor& t, float value) {
  if (value == 0.0f) {
    std::memset(t.GetDataPtr(), 0, t.numel() * element_bytes(t));
    return;
  }
  float* p = t.data_ptr<float>();
  std::fill(p, p + t.numel(), value);
}

}  // namespace

std::vector<int64_t> flash_attn_metadata(const FlashAttnMetadataCall& call) {
  attn::PlanConfig c = parsed_config(call);
  c.num_heads_q = call.num_heads_q;
  c.num_heads_kv = call.num_heads_kv;
  c.head_dim = call.head_dim;
  c.head_dim_v = call.head_dim_v.value_or(call.head_dim);
  c.batch_size = call.batch_size;
  c.max_seqlen_q = call.max_seqlen_q;
  c.max_seqlen_kv = call.max_seqlen_kv;
  c.num_workers = call.num_workers.value_or(ThreadExecutor().num_workers());
  c.deterministic = call.deterministic;
  c.backward = call.backward;
  const auto lengths = host_lengths(call);
  const std::vector<int32_t> words =
      checked([&] { return calls::plan_words(c, lengths->arrays()); });
  return std::vector<int64_t>(words.begin(), words.end());
}

py::object flash_attn(const FlashAttnCall& call) {
  const bool return_softmax_lse = call.return_softmax_lse;
  resolve({&call.q, &call.k, &call.v});
  resolve(call.sinks);
  resolve(call.alibi_slopes);
  resolve(call.k_scale);
  resolve(call.v_scale);
  attn::PlanConfig c = base_config(call);
  calls::FlashAttnShapes shapes = common::flash_attn_shapes(call.q, call.k, c);
  const auto lengths = host_lengths(call);
  auto table = std::make_shared<std::vector<int32_t>>(as_int32(block_table_of(call)));
  if (shapes.paged) {
    shapes.blocks_per_seq = blocks_per_seq(call);
    shapes.table = table->data();
    shapes.table_stride_b = shapes.blocks_per_seq;
    shapes.table_stride_j = 1;
  }
  const IntList metadata = values_of(call.metadata);
  const std::vector<int32_t> words = as_int32(metadata);
  const ThreadExecutor executor;
  // No heads at all (a rank's empty shard of the heads): the rest is checked as with heads.
  const bool no_heads = c.num_heads_q == 0 && c.num_heads_kv == 0;
  auto prepared = std::make_shared<calls::PreparedForward>(checked([&] {
    return calls::prepare_forward(with_heads(c), shapes, lengths->arrays(), call.max_seqlen_q,
                                  call.max_seqlen_kv, plan_words_of(words, metadata),
                                  executor.num_workers());
  }));
  if (no_heads) prepared->config.num_heads_q = prepared->config.num_heads_kv = 0;
  c = prepared->config;
  const common::FlashAttnOutputShapes out_shapes =
      common::flash_attn_output_shapes(call.q, c, return_softmax_lse);
  const std::vector<OutputSpec> outs{{call.q.data_type(), out_shapes.out},
                                     {mindspore::kNumberTypeFloat32, out_shapes.lse}};
  return launch("OpmeshFlashAttn", inputs_of(call), outs,
                [call, prepared, lengths, table, shapes, return_softmax_lse, no_heads](
                    const std::vector<ms::Tensor>& in, std::vector<ms::Tensor>& out) {
                  if (no_heads) return;  // empty outputs
                  if (prepared->padding) {
                    fill(out[0], 0.0f);
                    if (return_softmax_lse) fill(out[1], std::numeric_limits<float>::infinity());
                  }
                  const FlashAttnCall c = with_inputs(call, in);
                  const attn::FlashAttnParams p =
                      common::flash_attn_params(c, prepared->config, lengths->arrays(), shapes,
                                                out[0], return_softmax_lse ? &out[1] : nullptr);
                  const attn::Plan& plan = prepared->plan();
                  std::vector<float> workspace(static_cast<size_t>(
                      std::max<int64_t>(1, attn::workspace_floats(p.config, plan))));
                  checked([&] {
                    cpu_kernels().flash_attn(p, prepared->sequences, plan, ThreadExecutor(),
                                             workspace.data(), nullptr);
                    return 0;
                  });
                });
}

py::object flash_attn_backward(const FlashAttnBackwardCall& call) {
  attn::PlanConfig c = base_config(call);
  if (c.layout_kv == attn::Layout::kPagedBBND) value_error("layout_kv: PA_BBND has no backward");
  const attn::Layout lo = c.layout_out;
  require_rank(call.dout, lo == attn::Layout::kTND ? 3 : 4, "dout");
  require_rank(call.out, lo == attn::Layout::kTND ? 3 : 4, "out");
  require_rank(call.lse, lo == attn::Layout::kTND ? 2 : 3, "lse");
  const calls::FlashAttnShapes shapes = common::flash_attn_shapes(call.q, call.k, c);
  const auto lengths = host_lengths(call);
  const IntList metadata = values_of(call.metadata);
  const std::vector<int32_t> words = as_int32(metadata);
  const bool no_heads = c.num_heads_q == 0 && c.num_heads_kv == 0;
  auto prepared = std::make_shared<calls::PreparedBackward>(checked([&] {
    return calls::prepare_backward(with_heads(c), shapes, lengths->arrays(), call.max_seqlen_q,
                                   call.max_seqlen_kv, plan_words_of(words, metadata));
  }));
  const bool has_sinks = call.sinks.has_value();
  auto spec = [](const ms::Tensor& t) {
    return OutputSpec{t.data_type(), std::vector<int64_t>(t.shape().begin(), t.shape().end())};
  };
  const std::vector<OutputSpec> outs{
      spec(call.q), spec(call.k), spec(call.v),
      has_sinks ? spec(*call.sinks) : OutputSpec{mindspore::kNumberTypeFloat32, {0}}};
  const bool q_tnd = shapes.q_tnd;
  return launch("OpmeshFlashAttnBackward", inputs_of(call), outs,
                [call, prepared, q_tnd, no_heads](const std::vector<ms::Tensor>& in,
                                                  std::vector<ms::Tensor>& grads) {
                  for (auto& g : grads) fill(g, 0.0f);
                  if (no_heads) return;  // zero gradients (of no elements but the sinks')
                  const ms::Tensor outputs[4] = {grads[0], grads[1], grads[2], grads[3]};
                  const FlashAttnBackwardCall c = with_inputs(call, in);
                  const attn::FlashAttnBackwardParams p =
                      common::flash_attn_backward_params(c, prepared->config, q_tnd, outputs);
                  checked([&] {
                    cpu_kernels().flash_attn_backward(
                        p, prepared->sequences, ThreadExecutor(),
                        prepared->decoded ? &prepared->decoded->backward : nullptr);
                    return 0;
                  });
                });
}

}  // namespace opmesh::ms_binding
