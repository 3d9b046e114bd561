// The C++ entry points of libopmesh_ops (include/opmesh/ops.h).
#include "op_call.h"
#include "opmesh/ops.h"

#ifndef OPMESH_VERSION
#define OPMESH_VERSION "unknown"
#endif

namespace opmesh {

const char* library_version() { return OPMESH_VERSION; }

namespace {

template <class To, class From>
void assign(To& to, const From& from) {
  to = from;
}
void assign(std::optional<c10::SymInt>& to, const std::optional<int64_t>& from) {
  if (from.has_value()) to = c10::SymInt(*from);
}

// FlashAttnOptions' fields, one per keyword argument of flash_attn's declaration, in its order:
// a struct of the same fields in that order has its size.
#define OPMESH_MIRROR_ARG(kind, name)
#define OPMESH_MIRROR_ARG_D(kind, name, value) decltype(FlashAttnOptions::name) name;
struct FlashAttnOptionsMirror {
  OPMESH_OP_FLASH_ATTN(OPMESH_MIRROR_ARG, OPMESH_MIRROR_ARG_D, )
};
#undef OPMESH_MIRROR_ARG
#undef OPMESH_MIRROR_ARG_D
static_assert(sizeof(FlashAttnOptionsMirror) == sizeof(FlashAttnOptions),
              "FlashAttnOptions must hold exactly flash_attn's keyword arguments, in order");

}  // namespace

std::tuple<at::Tensor, at::Tensor> flash_attn(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, const FlashAttnOptions& o) {
  binding::FlashAttnCall call;
  call.q = q;
  call.k = k;
  call.v = v;
#define OPMESH_COPY_ARG(kind, name)
#define OPMESH_COPY_ARG_D(kind, name, value) assign(call.name, o.name);
  OPMESH_OP_FLASH_ATTN(OPMESH_COPY_ARG, OPMESH_COPY_ARG_D, )
#undef OPMESH_COPY_ARG
#undef OPMESH_COPY_ARG_D
  // The layouts' derived defaults, as in Python.
  call.layout_kv =
      !o.layout_kv.empty() ? o.layout_kv : (o.block_table.has_value() ? "PA_BBND" : o.layout_q);
  call.layout_out = o.layout_out.empty() ? o.layout_q : o.layout_out;
  return binding::tensors_of<2>(binding::call_op(call));
}

void kv_cache_write_(const at::Tensor& key, const std::optional<at::Tensor>& value,
                     const at::Tensor& key_cache, const std::optional<at::Tensor>& value_cache,
                     const at::Tensor& slot_mapping, const std::optional<at::Tensor>& key_scale,
                     const std::optional<at::Tensor>& value_scale) {
  binding::call_op(binding::KvCacheWriteCall{key, value, key_cache, value_cache, slot_mapping,
                                             key_scale, value_scale});
}

}  // namespace opmesh
