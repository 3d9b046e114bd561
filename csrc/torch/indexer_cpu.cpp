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

Outputs2 indexer_cpu(const IndexerCall& a) {
  const at::Tensor& q = a.query_index;
  const at::Tensor& k = a.key_index;
  const at::Tensor& w = a.weights;
  TORCH_CHECK_VALUE(q.device().is_cpu(), "query_index: expected a CPU tensor, got ", q.device());
  check_indexer_args(a);
  const core::DType qk_dtype = to_core_dtype(q.scalar_type(), "query_index");
  const core::Layout parsed = indexer_layout(a.layout);
  const core::MaskMode mode = static_cast<core::MaskMode>(a.sparse_mode);  // checked above
  const bool tnd = parsed == core::Layout::kTND;
  const int64_t off = tnd ? -1 : 0;  // TND has no batch dim
  const int64_t n1 = q.size(2 + off), n2 = k.size(2 + off), d = q.size(3 + off);
  const std::vector<int64_t> qlens = read_lengths(a.actual_seq_qlen);
  const std::vector<int64_t> klens = read_lengths(a.actual_seq_klen);

  core::IndexerParams p;
  p.layout = parsed;
  p.sparse_mode = mode;
  p.pre_tokens = a.pre_tokens;
  p.next_tokens = a.next_tokens;
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
  rethrow(
      [&] {
        if (n2 == 0) {
          // No heads: nothing to compute; the lengths and band are still checked as with heads.
          p.heads_q = p.heads_k = 1;
          core::validate(p);
          return;
        }
        core::dense_lightning_indexer_softmax_lse(p, AtenExecutor(), core::active_isa());
      },
      [&] {
        return c10::str("query_index: the scratch memory for N1=", n1, ", D=", d,
                        " could not be allocated");
      });
  return {softmax_max, softmax_sum};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, CPU, m) { impl<IndexerCall, indexer_cpu>(m); }

}  // namespace opmesh::binding
