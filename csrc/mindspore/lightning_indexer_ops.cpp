// lightning_indexer on MindSpore tensors: the shapes were checked by the shared torch shape
// function in Python; the core checks the host values (lengths, block table) and computes.
#include <memory>
#include <vector>

#include "conventions.h"
#include "cpu_features.h"
#include "indexer/lightning_indexer.h"
#include "ms_call.h"
#include "sequence_params.h"

namespace opmesh::ms_binding {

py::object lightning_indexer(const LightningIndexerCall& call) {
  resolve({&call.query, &call.key, &call.weights});
  const bool tnd = checked([&] {
                     return conventions::indexer_layout(call.layout_query, "layout_query");
                   }) == core::Layout::kTND;
  const bool paged = checked([&] { return conventions::indexer_key_layout(call.layout_key); }) ==
                     core::Layout::kPagedBBND;
  require_rank(call.query, tnd ? 3 : 4, "query");
  require_rank(call.key, paged || !tnd ? 4 : 3, "key");
  require_rank(call.weights, tnd ? 2 : 3, "weights");
  auto host = std::make_shared<common::HostArrays>(common::lightning_indexer_host(call));
  const core::LightningIndexerParams base =
      checked([&] { return common::lightning_indexer_params(call, *host); });
  // No heads at all (N1 = N2 = 0): nothing to compute; the rest is checked as with heads.
  const bool no_heads = base.heads_q == 0 && base.heads_k == 0;
  {
    core::LightningIndexerParams p = base;
    if (no_heads) p.heads_q = p.heads_k = 1;
    checked([&] {
      core::validate(p);
      return 0;
    });
  }
  const std::vector<int64_t> qs = call.query.shape();
  std::vector<int64_t> shape = {base.heads_k, base.sparse_count};
  shape.insert(shape.begin(), qs.begin(), qs.begin() + (tnd ? 1 : 2));
  const std::vector<OutputSpec> outs{
      {mindspore::kNumberTypeInt32, shape},
      {mindspore::kNumberTypeFloat32, call.return_value ? shape : std::vector<int64_t>{0}}};
  return launch("OpmeshLightningIndexer", inputs_of(call), outs,
                [call, base, host, no_heads](const std::vector<ms::Tensor>& in,
                                             std::vector<ms::Tensor>& out) {
                  core::LightningIndexerParams p = base;
                  p.indices = out[0].data_ptr<int32_t>();
                  p.values = call.return_value ? out[1].data_ptr<float>() : nullptr;
                  if (no_heads) return;
                  common::point_lightning_indexer(p, with_inputs(call, in));
                  checked([&] {
                    cpu_kernels().lightning_indexer(p, ThreadExecutor());
                    return 0;
                  });
                });
}

}  // namespace opmesh::ms_binding
