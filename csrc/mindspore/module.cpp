// opmesh's MindSpore extension module: the operators over the framework-neutral core, built by
// MindSpore's CustomOpBuilder (opmesh/platform/mindspore_ops.py loads it).
#include "cpu_features.h"
#include "ms_binding.h"

namespace py = pybind11;
using opmesh::ms_binding::FlashAttnHost;
using opmesh::ms_binding::FlashAttnOptions;
using opmesh::ms_binding::IntList;

namespace {

FlashAttnHost host(IntList cu_seqlens_q, IntList cu_seqlens_kv, IntList seqused_q,
                   IntList seqused_kv, IntList block_table, int64_t blocks_per_seq,
                   IntList metadata) {
  FlashAttnHost h;
  h.cu_seqlens_q = std::move(cu_seqlens_q);
  h.cu_seqlens_kv = std::move(cu_seqlens_kv);
  h.seqused_q = std::move(seqused_q);
  h.seqused_kv = std::move(seqused_kv);
  h.block_table = std::move(block_table);
  h.blocks_per_seq = blocks_per_seq;
  h.metadata = std::move(metadata);
  return h;
}

FlashAttnOptions options(std::optional<double> softmax_scale, int64_t mask_mode, int64_t win_left,
                         int64_t win_right, std::optional<int64_t> max_seqlen_q,
                         std::optional<int64_t> max_seqlen_kv, std::string layout_q,
                         std::string layout_kv, std::string layout_out) {
  FlashAttnOptions o;
  o.softmax_scale = softmax_scale;
  o.mask_mode = mask_mode;
  o.win_left = win_left;
  o.win_right = win_right;
  o.max_seqlen_q = max_seqlen_q;
  o.max_seqlen_kv = max_seqlen_kv;
  o.layout_q = std::move(layout_q);
  o.layout_kv = std::move(layout_kv);
  o.layout_out = std::move(layout_out);
  return o;
}

}  // namespace

PYBIND11_MODULE(MS_EXTENSION_NAME, m) {
  namespace b = opmesh::ms_binding;
  m.doc() = "opmesh's operators on MindSpore tensors (CPU)";
  m.def("active_isa",
        [] { return std::string(opmesh::core::isa_name(opmesh::core::active_isa())); });
  m.def("indexer", &b::indexer);
  m.def("indexer_grad_kl_loss", &b::indexer_grad_kl_loss);
  m.def("kv_cache_write", &b::kv_cache_write);
  m.def("flash_attn_metadata",
        [](int64_t nq, int64_t nkv, int64_t d, int64_t dv, IntList cu_q, IntList cu_kv,
           IntList used_q, IntList used_kv, int64_t batch_size, int64_t max_q, int64_t max_kv,
           int64_t mask_mode, int64_t win_left, int64_t win_right, std::string layout_q,
           std::string layout_kv, std::string layout_out, std::optional<int64_t> num_workers,
           bool deterministic, bool backward) {
          return b::flash_attn_metadata(
              nq, nkv, d, dv, host(cu_q, cu_kv, used_q, used_kv, {}, 0, {}), batch_size, max_q,
              max_kv,
              options({}, mask_mode, win_left, win_right, {}, {}, layout_q, layout_kv, layout_out),
              num_workers, deterministic, backward);
        });
  m.def("flash_attn", [](const ms::Tensor& q, const ms::Tensor& k, const ms::Tensor& v,
                         const std::optional<ms::Tensor>& sinks, IntList cu_q, IntList cu_kv,
                         IntList used_q, IntList used_kv, IntList block_table,
                         int64_t blocks_per_seq, IntList metadata,
                         std::optional<double> softmax_scale, int64_t mask_mode, int64_t win_left,
                         int64_t win_right, std::optional<int64_t> max_q,
                         std::optional<int64_t> max_kv, std::string layout_q, std::string layout_kv,
                         std::string layout_out, bool return_softmax_lse) {
    return b::flash_attn(q, k, v, sinks,
                         host(cu_q, cu_kv, used_q, used_kv, block_table, blocks_per_seq, metadata),
                         options(softmax_scale, mask_mode, win_left, win_right, max_q, max_kv,
                                 layout_q, layout_kv, layout_out),
                         return_softmax_lse);
  });
  m.def("flash_attn_backward",
        [](const ms::Tensor& dout, const ms::Tensor& q, const ms::Tensor& k, const ms::Tensor& v,
           const ms::Tensor& out, const ms::Tensor& lse, const std::optional<ms::Tensor>& dlse,
           const std::optional<ms::Tensor>& sinks, IntList cu_q, IntList cu_kv, IntList used_q,
           IntList used_kv, IntList metadata, std::optional<double> softmax_scale,
           int64_t mask_mode, int64_t win_left, int64_t win_right, std::optional<int64_t> max_q,
           std::optional<int64_t> max_kv, std::string layout_q, std::string layout_kv,
           std::string layout_out) {
          return b::flash_attn_backward(dout, q, k, v, out, lse, dlse, sinks,
                                        host(cu_q, cu_kv, used_q, used_kv, {}, 0, metadata),
                                        options(softmax_scale, mask_mode, win_left, win_right,
                                                max_q, max_kv, layout_q, layout_kv, layout_out));
        });
}
