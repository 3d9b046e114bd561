// CPU kernel of dense_lightning_indexer_softmax_lse: validates in the order device, dtype, rank,
// shape, values, fills the core's params and runs the core on PyTorch's thread pool.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "aten_executor.h"
#include "dtypes.h"
#include "errors.h"
#include "indexer_checks.h"

namespace opmesh::binding {
namespace {

// Reads a 1-D int32/int64 length tensor of `expected` entries into host memory.
std::vector<int64_t> read_lengths(const std::optional<at::Tensor>& lens, const char* name,
                                  int64_t expected, const at::Device& device) {
  if (!lens.has_value()) return {};
  const at::Tensor& t = *lens;
  TORCH_CHECK_VALUE(t.device() == device, name, ": expected a tensor on ", device, ", got ",
                    t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name,
                   ": expected int32 or int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1, name, ": expected a 1-D tensor, got shape ", t.sizes());
  if (expected >= 0) {
    TORCH_CHECK_VALUE(t.size(0) == expected, name, ": expected ", expected,
                      " entries (one per batch), got ", t.size(0));
  }
  const at::Tensor host = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
}

std::tuple<at::Tensor, at::Tensor> indexer_cpu(const at::Tensor& query_index,
                                               const at::Tensor& key_index,
                                               const at::Tensor& weights,
                                               const std::optional<at::Tensor>& actual_seq_qlen,
                                               const std::optional<at::Tensor>& actual_seq_klen,
                                               c10::string_view layout, int64_t sparse_mode) {
  const at::Tensor& q = query_index;
  const at::Tensor& k = key_index;
  const at::Tensor& w = weights;
  // Device.
  TORCH_CHECK_VALUE(q.device().is_cpu(), "query_index: expected a CPU tensor, got ", q.device());
  check_indexer_devices(q, k, w);
  // Dtype.
  const core::DType qk_dtype = to_core_dtype(q.scalar_type(), "query_index");
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type(), "key_index: expected dtype ",
                   q.scalar_type(), " like query_index, got ", k.scalar_type());
  TORCH_CHECK_TYPE(w.scalar_type() == q.scalar_type() || w.scalar_type() == at::kFloat,
                   "weights: expected dtype ", q.scalar_type(), " or float32, got ",
                   w.scalar_type());
  // Layout and ranks.
  const core::Layout parsed = indexer_layout(layout);
  const core::SparseMode mode = indexer_sparse_mode(sparse_mode);
  check_indexer_ranks(q, k, w, parsed);
  const bool tnd = parsed == core::Layout::kTND;
  // Shapes.
  const int64_t off = tnd ? -1 : 0;  // TND has no batch dim
  const int64_t n1 = q.size(2 + off), n2 = k.size(2 + off), d = q.size(3 + off);
  TORCH_CHECK_VALUE(k.size(3 + off) == d, "key_index: head dim ", k.size(3 + off),
                    " differs from query_index's ", d);
  TORCH_CHECK_VALUE(n2 >= 1 && n1 % n2 == 0, "key_index: query heads N1=", n1,
                    " must be a multiple of key heads N2=", n2);
  TORCH_CHECK_VALUE(d >= 1, "query_index: head dim D must be >= 1, got shape ", q.sizes());
  for (int64_t dim = 0; dim < w.dim(); ++dim) {
    TORCH_CHECK_VALUE(w.size(dim) == q.size(dim), "weights: expected shape ",
                      q.sizes().slice(0, w.dim()), " (query_index without D), got ", w.sizes());
  }
  if (!tnd) {
    TORCH_CHECK_VALUE(k.size(0) == q.size(0), "key_index: batch ", k.size(0),
                      " differs from query_index's ", q.size(0));
  }
  // Lengths and their values.
  const int64_t batch = tnd ? -1 : q.size(0);
  std::vector<int64_t> qlens = read_lengths(actual_seq_qlen, "actual_seq_qlen", batch, q.device());
  std::vector<int64_t> klens = read_lengths(actual_seq_klen, "actual_seq_klen", batch, q.device());
  if (tnd) {
    TORCH_CHECK_VALUE(actual_seq_qlen.has_value(),
                      "actual_seq_qlen: required for layout TND (cumulative query lengths)");
    TORCH_CHECK_VALUE(actual_seq_klen.has_value(),
                      "actual_seq_klen: required for layout TND (cumulative key lengths)");
    TORCH_CHECK_VALUE(qlens.size() == klens.size(), "actual_seq_klen: expected ", qlens.size(),
                      " entries like actual_seq_qlen, got ", klens.size());
  }

  core::IndexerParams p;
  p.layout = parsed;
  p.sparse_mode = mode;
  p.batch = tnd ? static_cast<int64_t>(qlens.size()) : q.size(0);
  p.seq_q = q.size(1 + off);
  p.seq_k = k.size(1 + off);
  p.heads_q = n1;
  p.heads_k = n2;
  p.head_dim = d;
  p.qk_dtype = qk_dtype;
  p.weights_dtype = to_core_dtype(w.scalar_type(), "weights");
  p.query = q.data_ptr();
  p.key = k.data_ptr();
  p.weights = w.data_ptr();
  for (int64_t i = 0; i < 4; ++i) {
    p.query_stride[i] = (i + off) >= 0 ? q.stride(i + off) : 0;
    p.key_stride[i] = (i + off) >= 0 ? k.stride(i + off) : 0;
  }
  for (int64_t i = 0; i < 3; ++i) p.weights_stride[i] = (i + off) >= 0 ? w.stride(i + off) : 0;
  p.seq_q_lens = qlens.empty() ? nullptr : qlens.data();
  p.seq_k_lens = klens.empty() ? nullptr : klens.data();

  const std::vector<int64_t> shape =
      tnd ? std::vector<int64_t>{n2, q.size(0)} : std::vector<int64_t>{q.size(0), n2, q.size(1)};
  at::Tensor softmax_max = at::empty(shape, q.options().dtype(at::kFloat));
  at::Tensor softmax_sum = at::empty(shape, q.options().dtype(at::kFloat));
  p.softmax_max = softmax_max.data_ptr<float>();
  p.softmax_sum = softmax_sum.data_ptr<float>();
  try {
    core::dense_lightning_indexer_softmax_lse(p, AtenExecutor(), core::active_isa());
  } catch (const core::ArgumentError& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  return {softmax_max, softmax_sum};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, CPU, m) { m.impl("dense_lightning_indexer_softmax_lse", &indexer_cpu); }

}  // namespace opmesh::binding
