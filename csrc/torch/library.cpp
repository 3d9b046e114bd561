// The C++ entry points of libopmesh_ops (include/opmesh/ops.h).
#include "op_call.h"
#include "opmesh/ops.h"

#ifndef OPMESH_VERSION
#define OPMESH_VERSION "unknown"
#endif

namespace opmesh {

const char* library_version() { return OPMESH_VERSION; }

std::tuple<at::Tensor, at::Tensor> flash_attn(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, const FlashAttnOptions& o) {
  binding::FlashAttnCall call;
  call.q = q;
  call.k = k;
  call.v = v;
  call.block_table = o.block_table;
  call.cu_seqlens_q = o.cu_seqlens_q;
  call.cu_seqlens_kv = o.cu_seqlens_kv;
  call.seqused_q = o.seqused_q;
  call.seqused_kv = o.seqused_kv;
  call.sinks = o.sinks;
  call.metadata = o.metadata;
  call.softmax_scale = o.softmax_scale;
  call.mask_mode = o.mask_mode;
  call.win_left = o.win_left;
  call.win_right = o.win_right;
  if (o.max_seqlen_q) call.max_seqlen_q = c10::SymInt(*o.max_seqlen_q);
  if (o.max_seqlen_kv) call.max_seqlen_kv = c10::SymInt(*o.max_seqlen_kv);
  call.layout_q = o.layout_q;
  call.layout_kv =
      !o.layout_kv.empty() ? o.layout_kv : (o.block_table.has_value() ? "PA_BBND" : o.layout_q);
  call.layout_out = o.layout_out.empty() ? o.layout_q : o.layout_out;
  call.return_softmax_lse = o.return_softmax_lse;
  return binding::tensors_of<2>(binding::call_op(call));
}

void kv_cache_write_(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  binding::call_op(binding::KvCacheWriteCall{key, value, key_cache, value_cache, slot_mapping});
}

}  // namespace opmesh
