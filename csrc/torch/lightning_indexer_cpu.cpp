// CPU kernel of lightning_indexer: checks, the core's params from the tensors, the core on
// PyTorch's thread pool.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "aten_executor.h"
#include "dtypes.h"
#include "indexer/lightning_indexer.h"
#include "indexer_checks.h"
#include "lightning_indexer_args.h"
#include "sequence_params.h"
#include "torch_access.h"

namespace opmesh::binding {
namespace {

Outputs2 lightning_indexer_cpu(const LightningIndexerCall& a) {
  TORCH_CHECK_VALUE(a.query.device().is_cpu(), "query: expected a CPU tensor, got ",
                    a.query.device());
  const LightningIndexerArgs r = check_lightning_indexer_args(a);
  auto [indices, values] = lightning_indexer_outputs(a, r);
  const common::HostArrays host = common::lightning_indexer_host(a);
  core::LightningIndexerParams p =
      rethrow([&] { return common::lightning_indexer_params(a, host); });
  common::point_lightning_indexer(p, a);
  p.indices = indices.data_ptr<int32_t>();
  p.values = a.return_value ? values.data_ptr<float>() : nullptr;
  rethrow(
      [&] {
        if (r.no_heads) {
          // No rows: nothing to compute; lengths, block table and band are still checked.
          p.heads_q = p.heads_k = 1;
          core::validate(p);
          return;
        }
        cpu_kernels().lightning_indexer(p, AtenExecutor());
      },
      [&] {
        return c10::str("sparse_count: the candidate buffers for K=", a.sparse_count,
                        " could not be allocated");
      });
  return {indices, values};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, CPU, m) { impl<LightningIndexerCall, lightning_indexer_cpu>(m); }

}  // namespace opmesh::binding
