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

at::Tensor metadata_cpu(int64_t num_heads_q, int64_t num_heads_kv, int64_t head_dim,
                        std::optional<int64_t> head_dim_v,
                        const std::optional<at::Tensor>& cu_seqlens_q,
                        const std::optional<at::Tensor>& cu_seqlens_kv,
                        const std::optional<at::Tensor>& seqused_q,
                        const std::optional<at::Tensor>& seqused_kv, int64_t batch_size,
                        int64_t max_seqlen_q, int64_t max_seqlen_kv, int64_t mask_mode,
                        int64_t win_left, int64_t win_right, c10::string_view layout_q,
                        c10::string_view layout_kv, c10::string_view layout_out,
                        std::optional<int64_t> num_workers, bool deterministic, bool backward) {
  attn::PlanConfig c;
  c.num_heads_q = num_heads_q;
  c.num_heads_kv = num_heads_kv;
  c.head_dim = head_dim;
  c.head_dim_v = head_dim_v.value_or(head_dim);
  c.batch_size = batch_size;
  c.max_seqlen_q = max_seqlen_q;
  c.max_seqlen_kv = max_seqlen_kv;
  c.mask_mode = parse_mask_mode(mask_mode);
  c.win_left = parse_window(win_left, "win_left");
  c.win_right = parse_window(win_right, "win_right");
  c.layout_q = parse_layout(layout_q, "layout_q");
  c.layout_kv = parse_layout(layout_kv, "layout_kv");
  c.layout_out = parse_layout(layout_out, "layout_out");
  c.num_workers = default_workers(num_workers);
  c.deterministic = deterministic;
  c.backward = backward;
  rethrow([&] {
    attn::validate_config(c);
    return 0;
  });
  check_plan_lengths(cu_seqlens_q, "cu_seqlens_q", batch_size + 1);
  check_plan_lengths(cu_seqlens_kv, "cu_seqlens_kv", batch_size + 1);
  check_plan_lengths(seqused_q, "seqused_q", batch_size);
  check_plan_lengths(seqused_kv, "seqused_kv", batch_size);
  const auto cq = host_ints(cu_seqlens_q);
  const auto ck = host_ints(cu_seqlens_kv);
  const auto uq = host_ints(seqused_q);
  const auto uk = host_ints(seqused_kv);
  const attn::LengthArrays lengths{cq.data(), ck.data(), uq.data(), uk.data()};
  const std::vector<int32_t> plan = rethrow([&] { return calls::plan_words(c, lengths); });
  at::Tensor out = at::empty({static_cast<int64_t>(plan.size())}, at::kInt);
  std::copy(plan.begin(), plan.end(), out.data_ptr<int32_t>());
  return out;
}

std::tuple<at::Tensor, at::Tensor> flash_attn_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_kv, const std::optional<at::Tensor>& seqused_q,
    const std::optional<at::Tensor>& seqused_kv, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& metadata, std::optional<double> softmax_scale,
    int64_t mask_mode, int64_t win_left, int64_t win_right, std::optional<int64_t> max_seqlen_q,
    std::optional<int64_t> max_seqlen_kv, c10::string_view layout_q, c10::string_view layout_kv,
    c10::string_view layout_out, bool return_softmax_lse) {
  TORCH_CHECK_VALUE(q.device().is_cpu(), "q: expected a CPU tensor, got ", q.device());
  const auto as_sym = [](std::optional<int64_t> v) {
    return v.has_value() ? std::optional<c10::SymInt>(c10::SymInt(*v)) : std::nullopt;
  };
  const FlashAttnArgs args = check_flash_attn_args(
      q, k, v, block_table, cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, sinks, metadata,
      softmax_scale, mask_mode, win_left, win_right, as_sym(max_seqlen_q), as_sym(max_seqlen_kv),
      layout_q, layout_kv, layout_out);
  const core::DType dtype = to_core_dtype(q.scalar_type(), "q");
  if (args.no_heads) return flash_attn_outputs(q, v, args, return_softmax_lse);
  attn::PlanConfig c = args.config;
  const bool paged = args.paged;
  const bool q_tnd = args.q_tnd;
  const bool kv_tnd = args.kv_tnd;
  const Axes& qa = args.qa;
  const Axes& ka = args.ka;
  c.batch_size = args.batch.expect_int();
  const auto cq = host_ints(cu_seqlens_q);
  const auto ck = host_ints(cu_seqlens_kv);
  const auto uq = host_ints(seqused_q);
  const auto uk = host_ints(seqused_kv);
  const attn::LengthArrays lengths{cq.data(), ck.data(), uq.data(), uk.data()};
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
    shapes.blocks_per_seq = block_table->size(1);
    shapes.table = block_table->data_ptr<int32_t>();
    shapes.table_stride_b = block_table->stride(0);
    shapes.table_stride_j = block_table->stride(1);
  }
  const HostInts words = host_ints(metadata);
  const calls::PlanWords given{words.data(), words.tensor.defined() ? words.tensor.numel() : 0};
  // Plan, or check the given plan against this call.
  const calls::PreparedForward prepared = rethrow([&] {
    return calls::prepare_forward(c, shapes, lengths, max_seqlen_q, max_seqlen_kv, given,
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
  if (return_softmax_lse) {
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
  p.v = view_of(v, c.layout_kv);
  if (paged) {
    p.block_table = shapes.table;
    p.bt_sb = shapes.table_stride_b;
    p.bt_sj = shapes.table_stride_j;
    p.block_size = shapes.block_size;
  }
  at::Tensor sink_values;
  if (sinks.has_value()) {
    sink_values = sinks->contiguous();
    p.sinks = sink_values.data_ptr<float>();
  }
  p.softmax_scale = args.softmax_scale;
  at::Tensor workspace = at::empty({std::max<int64_t>(1, attn::workspace_floats(c, *plan))},
                                   q.options().dtype(at::kFloat));
  WorkerTimes::Recording recording(static_cast<int64_t>(plan->workers.size()));
  attn::flash_attn(p, seqs, *plan, AtenExecutor(), core::active_isa(), workspace.data_ptr<float>(),
                   recording.data());
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, CPU, m) {
  m.impl("flash_attn_metadata", &metadata_cpu);
  m.impl("flash_attn", &flash_attn_cpu);
}

// With no tensor argument at all (fixed-length batches) the dispatcher has no backend to choose
// from; the metadata is a host-side plan either way.
TORCH_LIBRARY_IMPL(opmesh, CompositeExplicitAutograd, m) {
  m.impl("flash_attn_metadata", &metadata_cpu);
}

}  // namespace opmesh::binding
