// CPU kernels of flash_attn_metadata and flash_attn: validate (device, dtype, layout/rank, shape,
// values), plan or read the metadata, and run the core on PyTorch's thread pool.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

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
  at::Tensor out = at::empty({attn::metadata::size_words(c.num_workers)}, at::kInt);
  rethrow([&] {
    attn::metadata::write(c, lengths, out.data_ptr<int32_t>());
    return 0;
  });
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
  if (q_tnd) {
    TORCH_CHECK_VALUE(cq.data()[c.batch_size] == q.size(0), "cu_seqlens_q: last entry ",
                      cq.data()[c.batch_size], " must equal the query token count ", q.size(0));
  }
  if (kv_tnd) {
    TORCH_CHECK_VALUE(ck.data()[c.batch_size] == k.size(0), "cu_seqlens_kv: last entry ",
                      ck.data()[c.batch_size], " must equal the key token count ", k.size(0));
  }
  int64_t block_size = 0;
  int64_t blocks_per_seq = 0;
  const int32_t* table = nullptr;
  int64_t bt_sb = 0;
  int64_t bt_sj = 0;
  if (paged) {
    // Read in place through its strides: an expanded table is never copied, and only the
    // entries the call's sequences use are read.
    block_size = k.size(1);
    blocks_per_seq = block_table->size(1);
    table = block_table->data_ptr<int32_t>();
    bt_sb = block_table->stride(0);
    bt_sj = block_table->stride(1);
  }
  auto max_of = [&](const int32_t* cu, const int32_t* used, int64_t fallback) {
    return longest_length(cu, used, c.batch_size, fallback);
  };
  const bool use_metadata = metadata.has_value();
  // The shape's where the layout has a sequence axis, else the caller's, else -1 (left to the
  // metadata) or the observed maximum. A given value was checked against the shape and the
  // limits by check_flash_attn_args.
  auto resolve_max = [&](std::optional<int64_t> given, bool from_shape, int64_t shape_value,
                         int64_t observed) -> int64_t {
    if (from_shape) return shape_value;
    if (given.has_value()) return *given;
    return use_metadata ? -1 : observed;
  };
  c.max_seqlen_q =
      resolve_max(max_seqlen_q, !q_tnd, q_tnd ? 0 : q.size(qa.s), max_of(cq.data(), uq.data(), 0));
  c.max_seqlen_kv =
      resolve_max(max_seqlen_kv, !kv_tnd && !paged, (!kv_tnd && !paged) ? k.size(ka.s) : 0,
                  max_of(ck.data(), uk.data(), paged ? INT32_MAX : 0));
  if (paged) {
    for (int64_t b = 0; b < c.batch_size; ++b) {
      TORCH_CHECK_VALUE(uk.data()[b] <= blocks_per_seq * block_size, "seqused_kv: entry ", b,
                        " is ", uk.data()[b], ", more than block_table holds (", blocks_per_seq,
                        " blocks of ", block_size, ")");
    }
  }
  // Plan, or check the given plan against this call.
  std::optional<attn::metadata::Decoded> decoded;
  attn::Plan own_plan;
  const attn::Plan* plan = nullptr;
  if (use_metadata) {
    const at::Tensor words = metadata->to(at::kCPU).contiguous();
    decoded =
        rethrow([&] { return attn::metadata::read(words.data_ptr<int32_t>(), words.numel()); });
    rethrow([&] {
      attn::metadata::verify(*decoded, c, lengths);
      return 0;
    });
    c.max_seqlen_q = decoded->config.max_seqlen_q;
    c.max_seqlen_kv = decoded->config.max_seqlen_kv;
    c.num_workers = decoded->config.num_workers;
    c.deterministic = decoded->config.deterministic;
    plan = &decoded->plan;
  } else {
    c.num_workers = default_workers(std::nullopt);
  }
  rethrow([&] {
    attn::validate_config(c);
    return 0;
  });
  const std::vector<attn::Sequence> seqs =
      rethrow([&] { return attn::resolve_sequences(c, lengths); });
  if (paged) {
    const int64_t num_blocks = k.size(0);
    for (int64_t b = 0; b < c.batch_size; ++b) {
      const int64_t used = (seqs[b].k_len + block_size - 1) / block_size;
      for (int64_t j = 0; j < used; ++j) {
        const int32_t blk = table[b * bt_sb + j * bt_sj];
        TORCH_CHECK_VALUE(blk >= 0 && blk < num_blocks, "block_table: entry [", b, ", ", j, "] is ",
                          blk, ", expected a block index in [0, ", num_blocks, ")");
      }
    }
  }
  if (use_metadata) {
    try {
      attn::verify_coverage(c, seqs, *plan);
    } catch (const std::logic_error& e) {
      TORCH_CHECK_VALUE(false, "metadata: ", e.what());
    }
  } else {
    own_plan = attn::make_plan(c, seqs);
    plan = &own_plan;
  }

  // Outputs. The kernel writes every row a sequence uses; only when seqused leaves padding rows
  // (or TND tokens past a sequence's used length) must the outputs start as 0 / +inf.
  const int64_t batch = c.batch_size;
  const int64_t nq = c.num_heads_q;
  bool padding = false;
  for (int64_t b = 0; b < batch && !padding; ++b) {
    const int64_t rows = q_tnd ? cq.data()[b + 1] - cq.data()[b] : q.size(qa.s);
    padding = seqs[b].q_len < rows;
  }
  if (batch == 0 && (q_tnd ? q.size(0) : 0) > 0) padding = true;
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
    p.block_table = table;
    p.bt_sb = bt_sb;
    p.bt_sj = bt_sj;
    p.block_size = block_size;
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
