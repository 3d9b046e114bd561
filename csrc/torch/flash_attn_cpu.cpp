// CPU kernels of flash_attn_metadata and flash_attn: validate (device, dtype, layout/rank, shape,
// values), plan or read the metadata, and run the core on PyTorch's thread pool.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "aten_executor.h"
#include "attention/flash_attn.h"
#include "attention/metadata.h"
#include "core_calls.h"
#include "dtypes.h"
#include "errors.h"
#include "flash_attn_args.h"
#include "flash_attn_calls.h"
#include "flash_attn_params.h"
#include "output_memory.h"
#include "torch_access.h"
#include "worker_times.h"

namespace opmesh::binding {
namespace {

using core::ArgumentError;

// The call with its sinks and ALiBi slopes contiguous (float32 by the checks), as the core reads
// them.
FlashAttnCall readable(FlashAttnCall call) {
  if (call.sinks.has_value()) call.sinks = call.sinks->contiguous();
  if (call.alibi_slopes.has_value()) call.alibi_slopes = call.alibi_slopes->contiguous();
  return call;
}

int64_t default_workers(std::optional<int64_t> n) {
  return n.has_value() ? *n : std::max(1, at::get_num_threads());
}

at::Tensor metadata_cpu(const FlashAttnMetadataCall& a) {
  const int64_t batch_size = a.batch_size.expect_int();
  attn::PlanConfig c;
  c.num_heads_q = a.num_heads_q;
  c.num_heads_kv = a.num_heads_kv;
  c.head_dim = a.head_dim;
  c.head_dim_v = a.head_dim_v.value_or(a.head_dim);
  c.batch_size = batch_size;
  c.max_seqlen_q = a.max_seqlen_q.expect_int();
  c.max_seqlen_kv = a.max_seqlen_kv.expect_int();
  c.num_workers = default_workers(a.num_workers);
  c.deterministic = a.deterministic;
  c.backward = a.backward;
  rethrow([&] {
    const core::Mask mask = conventions::attention_mask(a.mask_mode, a.win_left, a.win_right);
    c.mask_mode = mask.mode;
    c.win_left = mask.left;
    c.win_right = mask.right;
    c.layout_q = conventions::attention_layout(a.layout_q, "layout_q");
    c.layout_kv = conventions::attention_layout(a.layout_kv, "layout_kv");
    c.layout_out = conventions::attention_layout(a.layout_out, "layout_out");
    attn::validate_config(c);
    return 0;
  });
  check_plan_lengths(a.cu_seqlens_q, "cu_seqlens_q", batch_size + 1);
  check_plan_lengths(a.cu_seqlens_kv, "cu_seqlens_kv", batch_size + 1);
  check_plan_lengths(a.seqused_q, "seqused_q", batch_size);
  check_plan_lengths(a.seqused_kv, "seqused_kv", batch_size);
  const HostLengths host(a);
  const attn::LengthArrays& lengths = host.arrays;
  const std::vector<int32_t> plan = rethrow([&] { return calls::plan_words(c, lengths); });
  at::Tensor out = at::empty({static_cast<int64_t>(plan.size())}, at::kInt);
  std::copy(plan.begin(), plan.end(), out.data_ptr<int32_t>());
  return out;
}

Outputs2 flash_attn_cpu(const FlashAttnCall& call) {
  const at::Tensor& q = call.q;
  const at::Tensor& k = call.k;
  TORCH_CHECK_VALUE(q.device().is_cpu(), "q: expected a CPU tensor, got ", q.device());
  const FlashAttnArgs args = check_flash_attn_args(call);
  if (args.no_heads) return flash_attn_outputs(q, call.v, args, call.return_softmax_lse);
  attn::PlanConfig c = args.config;
  c.batch_size = args.batch.expect_int();
  const HostLengths host(call);
  const attn::LengthArrays& lengths = host.arrays;
  calls::FlashAttnShapes shapes = common::flash_attn_shapes(q, k, c);
  if (shapes.paged) {
    // Read in place through its strides: an expanded table is never copied, and only the
    // entries the call's sequences use are read.
    shapes.blocks_per_seq = call.block_table->size(1);
    shapes.table = call.block_table->data_ptr<int32_t>();
    shapes.table_stride_b = call.block_table->stride(0);
    shapes.table_stride_j = call.block_table->stride(1);
  }
  const HostInts words = host_ints(call.metadata);
  const calls::PlanWords given{words.data(), words.tensor.defined() ? words.tensor.numel() : 0};
  // Plan, or check the given plan against this call.
  const calls::PreparedForward prepared = rethrow([&] {
    return calls::prepare_forward(c, shapes, lengths, concrete_or_none(call.max_seqlen_q),
                                  concrete_or_none(call.max_seqlen_kv), given,
                                  default_workers(std::nullopt));
  });
  c = prepared.config;
  const std::vector<attn::Sequence>& seqs = prepared.sequences;
  const attn::Plan* plan = &prepared.plan();

  // Outputs. The kernel writes every row a sequence uses; only when seqused leaves padding rows
  // (or TND tokens past a sequence's used length) must the outputs start as 0 / +inf.
  const bool padding = prepared.padding;
  auto make_out = [&](at::IntArrayRef shape) {
    at::Tensor t = empty_output(shape, q.options());
    return padding ? t.zero_() : t;
  };
  const common::FlashAttnOutputShapes out_shapes =
      common::flash_attn_output_shapes(q, c, call.return_softmax_lse);
  const at::Tensor out = make_out(out_shapes.out);
  const auto lse_options = q.options().dtype(at::kFloat);
  at::Tensor lse = padding && call.return_softmax_lse
                       ? at::full(out_shapes.lse, INFINITY, lse_options)
                       : at::empty(out_shapes.lse, lse_options);
  const FlashAttnCall core_call = readable(call);  // owns what the params point into
  const attn::FlashAttnParams p = common::flash_attn_params(
      core_call, c, lengths, shapes, out, call.return_softmax_lse ? &lse : nullptr);
  // The split units' partial states; a plan without split units needs none.
  const at::Tensor workspace =
      plan->num_slots > 0 ? at::empty({std::max<int64_t>(1, attn::workspace_floats(c, *plan))},
                                      q.options().dtype(at::kFloat))
                          : at::Tensor();
  WorkerTimes::Recording recording(static_cast<int64_t>(plan->workers.size()));
  cpu_kernels().flash_attn(p, seqs, *plan, AtenExecutor(),
                           workspace.defined() ? workspace.data_ptr<float>() : nullptr,
                           recording.data());
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, CPU, m) {
  impl<FlashAttnMetadataCall, metadata_cpu>(m);
  impl<FlashAttnCall, flash_attn_cpu>(m);
}

// With no tensor argument at all (fixed-length batches) the dispatcher has no backend to choose
// from; the metadata is a host-side plan either way.
TORCH_LIBRARY_IMPL(opmesh, CompositeExplicitAutograd, m) {
  impl<FlashAttnMetadataCall, metadata_cpu>(m);
}

}  // namespace opmesh::binding
