// The C++ entry points of libopmesh_ops (include/opmesh/ops.h).
#include <ATen/core/dispatch/Dispatcher.h>

#include "op_signatures.h"
#include "opmesh/ops.h"

#ifndef OPMESH_VERSION
#define OPMESH_VERSION "unknown"
#endif

namespace opmesh {

const char* library_version() { return OPMESH_VERSION; }

namespace {

using binding::FlashAttnSig;
using binding::KvCacheWriteSig;

std::optional<c10::SymInt> sym(std::optional<int64_t> value) {
  if (!value.has_value()) return std::nullopt;
  return c10::SymInt(*value);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> flash_attn(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, const FlashAttnOptions& o) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("opmesh::flash_attn", "")
                             .typed<FlashAttnSig>();
  const std::string layout_kv =
      !o.layout_kv.empty() ? o.layout_kv : (o.block_table.has_value() ? "PA_BBND" : o.layout_q);
  const std::string layout_out = o.layout_out.empty() ? o.layout_q : o.layout_out;
  return op.call(q, k, v, o.block_table, o.cu_seqlens_q, o.cu_seqlens_kv, o.seqused_q, o.seqused_kv,
                 o.sinks, o.metadata, o.softmax_scale, o.mask_mode, o.win_left, o.win_right,
                 sym(o.max_seqlen_q), sym(o.max_seqlen_kv), o.layout_q, layout_kv, layout_out,
                 o.return_softmax_lse);
}

void kv_cache_write_(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("opmesh::kv_cache_write_", "")
                             .typed<KvCacheWriteSig>();
  op.call(key, value, key_cache, value_cache, slot_mapping);
}

}  // namespace opmesh
