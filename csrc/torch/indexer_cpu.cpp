// CPU kernel of dense_lightning_indexer_softmax_lse: validates in the order device, dtype, rank,
// shape, values, fills the core's params and runs the core on PyTorch's thread pool.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "aten_executor.h"
#include "dtypes.h"
#include "indexer_checks.h"
#include "sequence_params.h"
#include "torch_access.h"

namespace opmesh::binding {

namespace {

Outputs2 indexer_cpu(const IndexerCall& a) {
  TORCH_CHECK_VALUE(a.query_index.device().is_cpu(), "query_index: expected a CPU tensor, got ",
                    a.query_index.device());
  check_indexer_args(a);
  const common::HostArrays host = common::indexer_host(a);
  core::IndexerParams p = rethrow([&] { return common::indexer_params(a, host); });
  common::point_indexer(p, a);
  const std::vector<int64_t> shape = p.layout == core::Layout::kTND
                                         ? std::vector<int64_t>{p.heads_k, p.seq_q}
                                         : std::vector<int64_t>{p.batch, p.heads_k, p.seq_q};
  const auto f32 = a.query_index.options().dtype(at::kFloat);
  at::Tensor softmax_max = at::empty(shape, f32);
  at::Tensor softmax_sum = at::empty(shape, f32);
  p.softmax_max = softmax_max.data_ptr<float>();
  p.softmax_sum = softmax_sum.data_ptr<float>();
  const int64_t n1 = p.heads_q, d = p.head_dim;
  rethrow(
      [&] {
        if (p.heads_k == 0) {
          // No heads: nothing to compute; the lengths and band are still checked as with heads.
          p.heads_q = p.heads_k = 1;
          core::validate(p);
          return;
        }
        cpu_kernels().dense_lightning_indexer_softmax_lse(p, AtenExecutor());
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
