// Shape function of lightning_indexer for fake tensors and torch.compile: symbolic sizes stay
// symbolic (head counts, head dim and sparse_count are part of the kernel's shape).
#include <torch/library.h>

#include "lightning_indexer_args.h"

namespace opmesh::binding {
namespace {

Outputs2 lightning_indexer_meta(const LightningIndexerCall& call) {
  return lightning_indexer_outputs(call, check_lightning_indexer_args(call));
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, Meta, m) { impl<LightningIndexerCall, lightning_indexer_meta>(m); }

}  // namespace opmesh::binding
