// Shape function of flash_attn for fake tensors and torch.compile. Sizes stay symbolic, so dynamic
// shapes need no recompilation. flash_attn_metadata's fake lives in opmesh/_fake.py: with no
// tensor argument at all there is no device for a Meta kernel to follow, and the plan is a CPU
// tensor whatever the inputs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "flash_attn_args.h"

namespace opmesh::binding {
namespace {

std::tuple<at::Tensor, at::Tensor> flash_attn_meta(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_kv, const std::optional<at::Tensor>& seqused_q,
    const std::optional<at::Tensor>& seqused_kv, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& metadata, std::optional<double> softmax_scale,
    int64_t mask_mode, int64_t win_left, int64_t win_right, std::optional<c10::SymInt> max_seqlen_q,
    std::optional<c10::SymInt> max_seqlen_kv, c10::string_view layout_q, c10::string_view layout_kv,
    c10::string_view layout_out, bool return_softmax_lse) {
  const FlashAttnArgs args = check_flash_attn_args(
      q, k, v, block_table, cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv, sinks, metadata,
      softmax_scale, mask_mode, win_left, win_right, max_seqlen_q, max_seqlen_kv, layout_q,
      layout_kv, layout_out);
  return flash_attn_outputs(q, v, args, return_softmax_lse);
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, Meta, m) { m.impl("flash_attn", &flash_attn_meta); }

}  // namespace opmesh::binding
