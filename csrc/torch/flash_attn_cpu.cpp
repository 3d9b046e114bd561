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
#include "worker_times.h"

namespace opmesh::binding {
namespace {

using core::ArgumentError;

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
  const core::DType dtype = to_core_dtype(q.scalar_type(), "q");
  if (args.no_heads) return flash_attn_outputs(q, call.v, args, call.return_softmax_lse);
  attn::PlanConfig c = args.config;
  const bool paged = args.paged;
  const bool q_tnd = args.q_tnd;
  const bool kv_tnd = args.kv_tnd;
  const Axes& qa = args.qa;
  const Axes& ka = args.ka;
  c.batch_size = args.batch.expect_int();
  const HostLengths host(call);
  const attn::LengthArrays& lengths = host.arrays;
  calls::FlashAttnShapes shapes;
  shapes.q_tnd = q_tnd;
  shapes.kv_tnd = kv_tnd;
  shapes.paged = paged;
  shapes.q_tokens = q_tnd ? q.size(0) : 0;
  shapes.kv_tokens = kv_tnd ? k.size(0) : 0;
  shapes.q_seq = q_tnd ? 0 : q.size(qa.s);
  shapes.kv_seq = (!kv_tnd && !paged) ? k.size(ka.s) : 0;
  if (paged) {
    // Read in place through its strides: an expanded table is never copied, and only the
    // entries the call's sequences use are read.
    shapes.num_blocks = k.size(0);
    shapes.block_size = k.size(1);
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
  const int64_t batch = c.batch_size;
  const int64_t nq = c.num_heads_q;
  const bool padding = prepared.padding;
  auto make_out = [&](at::IntArrayRef shape) {
    return padding ? at::zeros(shape, q.options()) : at::empty(shape, q.options());
  };
  at::Tensor out;
  at::Tensor lse;
  attn::FlashAttnParams p;
  if (q_tnd) {
    out = make_out({q.size(0), nq, c.head_dim_v});
    p.out_sb = 0;
    p.out_ss = out.stride(0);
    p.out_sn = out.stride(1);
  } else {
    const int64_t s1 = q.size(qa.s);
    const bool bnsd = c.layout_out == attn::Layout::kBNSD;
    out = make_out(bnsd ? std::vector<int64_t>{batch, nq, s1, c.head_dim_v}
                        : std::vector<int64_t>{batch, s1, nq, c.head_dim_v});
    p.out_sb = out.stride(0);
    p.out_ss = out.stride(bnsd ? 2 : 1);
    p.out_sn = out.stride(bnsd ? 1 : 2);
  }
  p.out_sd = out.stride(-1);
  if (call.return_softmax_lse) {
    const auto lse_options = q.options().dtype(at::kFloat);
    const std::vector<int64_t> shape =
        q_tnd ? std::vector<int64_t>{nq, q.size(0)} : std::vector<int64_t>{batch, nq, q.size(qa.s)};
    lse = padding ? at::full(shape, INFINITY, lse_options) : at::empty(shape, lse_options);
    p.lse = lse.data_ptr<float>();
    p.lse_sb = q_tnd ? 0 : lse.stride(0);
    p.lse_sn = lse.stride(q_tnd ? 0 : 1);
    p.lse_ss = lse.stride(q_tnd ? 1 : 2);
  } else {
    lse = at::empty({0}, q.options().dtype(at::kFloat));
  }
  p.out = out.data_ptr();
  p.config = c;
  p.lengths = lengths;
  p.dtype = dtype;
  p.q = view_of(q, c.layout_q);
  p.k = view_of(k, c.layout_kv);
  p.v = view_of(call.v, c.layout_kv);
  if (paged) {
    p.block_table = shapes.table;
    p.bt_sb = shapes.table_stride_b;
    p.bt_sj = shapes.table_stride_j;
    p.block_size = shapes.block_size;
  }
  at::Tensor sink_values;
  if (call.sinks.has_value()) {
    sink_values = call.sinks->contiguous();
    p.sinks = sink_values.data_ptr<float>();
  }
  p.softmax_scale = args.softmax_scale;
  const at::Tensor slopes = set_score_mods(call, p);
  at::Tensor workspace = at::empty({std::max<int64_t>(1, attn::workspace_floats(c, *plan))},
                                   q.options().dtype(at::kFloat));
  WorkerTimes::Recording recording(static_cast<int64_t>(plan->workers.size()));
  cpu_kernels().flash_attn(p, seqs, *plan, AtenExecutor(), workspace.data_ptr<float>(),
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
