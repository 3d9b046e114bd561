// Shape function of flash_attn for fake tensors and torch.compile. Sizes stay symbolic, so dynamic
// shapes need no recompilation. flash_attn_metadata's fake lives in opmesh/_fake.py: with no
// tensor argument at all there is no device for a Meta kernel to follow, and the plan is a CPU
// tensor whatever the inputs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "flash_attn_args.h"

namespace opmesh::binding {
namespace {

Outputs2 flash_attn_meta(const FlashAttnCall& call) {
  return flash_attn_outputs(call.q, call.v, check_flash_attn_args(call), call.return_softmax_lse);
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, Meta, m) { impl<FlashAttnCall, flash_attn_meta>(m); }

}  // namespace opmesh::binding
