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
#include "dtypes.h"
#include "errors.h"
#include "flash_attn_args.h"
#include "worker_times.h"

namespace opmesh::binding {
namespace {

using core::ArgumentError;

// A host copy of an optional int32 length array with `count` entries.
struct HostInts {
  at::Tensor tensor;  // contiguous int32 on the CPU, or undefined
  const int32_t* data() const { return tensor.defined() ? tensor.data_ptr<int32_t>() : nullptr; }
};

HostInts host_ints(const std::optional<at::Tensor>& t, const char* name, int64_t count,
                   const std::optional<at::Device>& device) {
  if (!t.has_value()) return {};
  if (device.has_value()) {
    TORCH_CHECK_VALUE(t->device() == *device, name, ": expected a tensor on ", *device, ", got ",
                      t->device());
  }
  TORCH_CHECK_TYPE(t->scalar_type() == at::kInt, name, ": expected int32, got ", t->scalar_type());
  TORCH_CHECK_VALUE(t->dim() == 1, name, ": expected a 1-D tensor, got shape ", t->sizes());
  if (count >= 0) {
    TORCH_CHECK_VALUE(t->size(0) == count, name, ": expected ", count, " entries, got ",
                      t->size(0));
  }
  return {t->to(at::kCPU).contiguous()};
}

template <class F>
auto rethrow(F&& f) {
  try {
    return f();
  } catch (const ArgumentError& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

int64_t default_workers(std::optional<int64_t> n) {
  return n.has_value() ? *n : std::max(1, at::get_num_threads());
}

at::Tensor metadata_cpu(
    int64_t num_heads_q, int64_t num_heads_kv, int64_t head_dim, std::optional<int64_t> head_dim_v,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_kv,
    const std::optional<at::Tensor>& seqused_q, const std::optional<at::Tensor>& seqused_kv,
    int64_t batch_size, int64_t max_seqlen_q, int64_t max_seqlen_kv, int64_t mask_mode,
    int64_t win_left, int64_t win_right, c10::string_view layout_q, c10::string_view layout_kv,
    c10::string_view layout_out, std::optional<int64_t> num_workers, bool deterministic) {
  attn::PlanConfig c;
  c.num_heads_q = num_heads_q;
  c.num_heads_kv = num_heads_kv;
  c.head_dim = head_dim;
  c.head_dim_v = head_dim_v.value_or(head_dim);
  c.batch_size = batch_size;
  c.max_seqlen_q = max_seqlen_q;
  c.max_seqlen_kv = max_seqlen_kv;
  c.mask_mode = static_cast<attn::MaskMode>(mask_mode);
  c.win_left = win_left;
  c.win_right = win_right;
  c.layout_q = parse_layout(layout_q, "layout_q");
  c.layout_kv = parse_layout(layout_kv, "layout_kv");
  c.layout_out = parse_layout(layout_out, "layout_out");
  c.num_workers = default_workers(num_workers);
  c.deterministic = deterministic;
  TORCH_CHECK_VALUE(batch_size <= INT32_MAX, "batch_size: too large: ", batch_size);
  TORCH_CHECK_VALUE(max_seqlen_q <= INT32_MAX, "max_seqlen_q: too large: ", max_seqlen_q);
  TORCH_CHECK_VALUE(max_seqlen_kv <= INT32_MAX, "max_seqlen_kv: too large: ", max_seqlen_kv);
  rethrow([&] {
    attn::validate_config(c);
    return 0;
  });
  const auto cq = host_ints(cu_seqlens_q, "cu_seqlens_q", batch_size + 1, std::nullopt);
  const auto ck = host_ints(cu_seqlens_kv, "cu_seqlens_kv", batch_size + 1, std::nullopt);
  const auto uq = host_ints(seqused_q, "seqused_q", batch_size, std::nullopt);
  const auto uk = host_ints(seqused_kv, "seqused_kv", batch_size, std::nullopt);
  const attn::LengthArrays lengths{cq.data(), ck.data(), uq.data(), uk.data()};
  at::Tensor out = at::empty({attn::metadata::size_words(c.num_workers)}, at::kInt);
  rethrow([&] {
    attn::metadata::write(c, lengths, out.data_ptr<int32_t>());
    return 0;
  });
  return out;
}

attn::View view_of(const at::Tensor& t, attn::Layout layout) {
  const Axes a = axes_of(layout);
  attn::View v;
  v.data = t.data_ptr();
  v.sb = a.b >= 0 ? t.stride(a.b) : 0;
  v.ss = t.stride(a.s);
  v.sn = t.stride(a.n);
  v.sd = t.stride(a.d);
  return v;
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
  // Device.
  TORCH_CHECK_VALUE(q.device().is_cpu(), "q: expected a CPU tensor, got ", q.device());
  check_devices(q, k, v, block_table, sinks);
  // Dtype.
  const core::DType dtype = to_core_dtype(q.scalar_type(), "q");
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type(), "k: expected dtype ", q.scalar_type(),
                   " like q, got ", k.scalar_type());
  TORCH_CHECK_TYPE(v.scalar_type() == q.scalar_type(), "v: expected dtype ", q.scalar_type(),
                   " like q, got ", v.scalar_type());
  if (sinks.has_value()) {
    TORCH_CHECK_TYPE(sinks->scalar_type() == at::kFloat, "sinks: expected float32, got ",
                     sinks->scalar_type());
  }
  if (block_table.has_value()) {
    TORCH_CHECK_TYPE(block_table->scalar_type() == at::kInt, "block_table: expected int32, got ",
                     block_table->scalar_type());
  }
  // Layouts and ranks.
  attn::PlanConfig c;
  c.layout_q = parse_layout(layout_q, "layout_q");
  c.layout_kv = parse_layout(layout_kv, "layout_kv");
  c.layout_out = parse_layout(layout_out, "layout_out");
  c.mask_mode = static_cast<attn::MaskMode>(mask_mode);
  c.win_left = win_left;
  c.win_right = win_right;
  TORCH_CHECK_VALUE(c.layout_q != attn::Layout::kPagedBBND,
                    "layout_q: expected 'BSND', 'BNSD' or 'TND', got 'PA_BBND'");
  check_rank(q, c.layout_q, "q");
  check_rank(k, c.layout_kv, "k");
  check_rank(v, c.layout_kv, "v");
  const bool paged = c.layout_kv == attn::Layout::kPagedBBND;
  const bool q_tnd = c.layout_q == attn::Layout::kTND;
  const bool kv_tnd = c.layout_kv == attn::Layout::kTND;
  const Axes qa = axes_of(c.layout_q);
  const Axes ka = axes_of(c.layout_kv);
  // Shapes.
  c.num_heads_q = q.size(qa.n);
  c.num_heads_kv = k.size(ka.n);
  c.head_dim = q.size(qa.d);
  c.head_dim_v = v.size(ka.d);
  TORCH_CHECK_VALUE(k.size(ka.d) == c.head_dim, "k: head_dim ", k.size(ka.d), " differs from q's ",
                    c.head_dim);
  TORCH_CHECK_VALUE(v.size(ka.n) == c.num_heads_kv, "v: ", v.size(ka.n), " heads differ from k's ",
                    c.num_heads_kv);
  for (int dim : {ka.b, ka.s}) {
    if (dim >= 0) {
      TORCH_CHECK_VALUE(v.size(dim) == k.size(dim), "v: shape ", v.sizes(), " does not match k's ",
                        k.sizes(), " outside the head dim");
    }
  }
  if (q_tnd) {
    TORCH_CHECK_VALUE(cu_seqlens_q.has_value(), "cu_seqlens_q: required for layout_q TND");
    c.batch_size = cu_seqlens_q->numel() - 1;
    TORCH_CHECK_VALUE(c.batch_size >= 0, "cu_seqlens_q: expected batch_size + 1 >= 1 entries");
  } else {
    c.batch_size = q.size(qa.b);
  }
  if (!paged && !kv_tnd) {
    TORCH_CHECK_VALUE(k.size(ka.b) == c.batch_size, "k: batch ", k.size(ka.b), " differs from q's ",
                      c.batch_size);
  }
  if (sinks.has_value()) {
    TORCH_CHECK_VALUE(sinks->dim() == 1 && sinks->size(0) == c.num_heads_q,
                      "sinks: expected shape [", c.num_heads_q, "] (one per query head), got ",
                      sinks->sizes());
  }
  const std::optional<at::Device> dev = q.device();
  const auto cq = host_ints(cu_seqlens_q, "cu_seqlens_q", c.batch_size + 1, dev);
  const auto ck = host_ints(cu_seqlens_kv, "cu_seqlens_kv", c.batch_size + 1, dev);
  const auto uq = host_ints(seqused_q, "seqused_q", c.batch_size, dev);
  const auto uk = host_ints(seqused_kv, "seqused_kv", c.batch_size, dev);
  const attn::LengthArrays lengths{cq.data(), ck.data(), uq.data(), uk.data()};
  if (q_tnd) {
    TORCH_CHECK_VALUE(cq.data()[c.batch_size] == q.size(0), "cu_seqlens_q: last entry ",
                      cq.data()[c.batch_size], " must equal the query token count ", q.size(0));
  }
  if (kv_tnd) {
    TORCH_CHECK_VALUE(ck.data() != nullptr, "cu_seqlens_kv: required for layout_kv TND");
    TORCH_CHECK_VALUE(ck.data()[c.batch_size] == k.size(0), "cu_seqlens_kv: last entry ",
                      ck.data()[c.batch_size], " must equal the key token count ", k.size(0));
  }
  int64_t block_size = 0;
  int64_t blocks_per_seq = 0;
  HostInts table;
  if (paged) {
    TORCH_CHECK_VALUE(block_table.has_value(), "block_table: required with layout_kv PA_BBND");
    TORCH_CHECK_VALUE(block_table->dim() == 2 && block_table->size(0) == c.batch_size,
                      "block_table: expected shape [", c.batch_size, ", max_blocks_per_seq], got ",
                      block_table->sizes());
    TORCH_CHECK_VALUE(uk.data() != nullptr || c.batch_size == 0,
                      "seqused_kv: required with layout_kv PA_BBND");
    block_size = k.size(1);
    blocks_per_seq = block_table->size(1);
    TORCH_CHECK_VALUE(block_size >= 1, "k: block size must be >= 1, got shape ", k.sizes());
    table.tensor = block_table->contiguous();
  } else {
    TORCH_CHECK_VALUE(!block_table.has_value(),
                      "block_table: only accepted with layout_kv PA_BBND");
  }
  // Maximum lengths: the shape's where the layout has a sequence axis, else given or observed.
  auto max_of = [&](const int32_t* cu, const int32_t* used, int64_t fallback) {
    int64_t m = 0;
    for (int64_t b = 0; b < c.batch_size; ++b) {
      int64_t len = cu ? cu[b + 1] - cu[b] : fallback;
      if (used) len = std::min<int64_t>(len, used[b]);
      m = std::max(m, len);
    }
    return m;
  };
  const bool use_metadata = metadata.has_value();
  // -1: leave it to the metadata (only where neither a shape nor the caller fixes it).
  auto resolve_max = [&](std::optional<int64_t> given, bool from_shape, int64_t shape_value,
                         int64_t observed, const char* name) -> int64_t {
    if (from_shape) {
      TORCH_CHECK_VALUE(!given.has_value() || *given == shape_value, name, ": ", *given,
                        " differs from the sequence length ", shape_value, " of the tensor");
      return shape_value;
    }
    if (given.has_value()) {
      TORCH_CHECK_VALUE(*given >= 0, name, ": must be >= 0, got ", *given);
      return *given;
    }
    return use_metadata ? -1 : observed;
  };
  c.max_seqlen_q = resolve_max(max_seqlen_q, !q_tnd, q_tnd ? 0 : q.size(qa.s),
                               max_of(cq.data(), uq.data(), 0), "max_seqlen_q");
  c.max_seqlen_kv =
      resolve_max(max_seqlen_kv, !kv_tnd && !paged, (!kv_tnd && !paged) ? k.size(ka.s) : 0,
                  max_of(ck.data(), uk.data(), paged ? INT32_MAX : 0), "max_seqlen_kv");
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
    const at::Tensor& md = *metadata;
    TORCH_CHECK_VALUE(md.device().is_cpu(), "metadata: expected a CPU tensor, got ", md.device());
    TORCH_CHECK_TYPE(md.scalar_type() == at::kInt, "metadata: expected int32, got ",
                     md.scalar_type());
    TORCH_CHECK_VALUE(md.dim() == 1, "metadata: expected a 1-D tensor, got shape ", md.sizes());
    const at::Tensor words = md.contiguous();
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
    const int32_t* bt = table.data();
    const int64_t num_blocks = k.size(0);
    for (int64_t b = 0; b < c.batch_size; ++b) {
      const int64_t used = (seqs[b].k_len + block_size - 1) / block_size;
      for (int64_t j = 0; j < used; ++j) {
        const int32_t blk = bt[b * blocks_per_seq + j];
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
    p.block_table = table.data();
    p.bt_sb = blocks_per_seq;
    p.bt_sj = 1;
    p.block_size = block_size;
  }
  at::Tensor sink_values;
  if (sinks.has_value()) {
    sink_values = sinks->contiguous();
    p.sinks = sink_values.data_ptr<float>();
  }
  p.softmax_scale =
      static_cast<float>(softmax_scale.value_or(1.0 / std::sqrt(static_cast<double>(c.head_dim))));
  TORCH_CHECK_VALUE(std::isfinite(p.softmax_scale), "softmax_scale: must be finite, got ",
                    p.softmax_scale);
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
