// The core's params of kv_cache_write_ from a checked call struct of any binding (tensors read
// through tensor_access.h), in the two steps of sequence_params.h: sizes and slots, then the
// tensors' pointers and strides.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "kv_cache.h"
#include "tensor_access.h"

namespace opmesh::common {

// `slots`: the call's slot mapping on the host, kept alive with the params.
template <class Call>
core::KvCacheWriteParams kv_cache_params(const Call& c, const std::vector<int64_t>& slots) {
  core::KvCacheWriteParams p;
  const std::vector<int64_t> ks = sizes_of(c.key), cs = sizes_of(c.key_cache);
  p.tokens = ks[0];
  p.heads = ks[1];
  p.dim_k = ks[2];
  p.dim_v = c.value.has_value() ? sizes_of(*c.value)[2] : 0;
  p.elem_bytes = element_size_of(c.key);
  p.format = TensorAccess<std::decay_t<decltype(c.key)>>::cache_format(c.key_cache);
  if (p.format != core::CacheFormat::kPlain) p.dtype = dtype_of(c.key, "key");
  p.num_blocks = cs[0];
  p.block_size = cs[1];
  p.slots = slots.data();
  return p;
}

// key and value [token][head][dim], the caches [block][offset][head][dim] (written in place);
// without value and value_cache, the key side alone.
template <class Call>
void point_kv_cache(core::KvCacheWriteParams& p, const Call& c) {
  p.key = layout_view(c.key, -1);
  p.key_cache = mutable_layout_view(c.key_cache, 0);
  if (c.value.has_value()) p.value = layout_view(*c.value, -1);
  if (c.value_cache.has_value()) p.value_cache = mutable_layout_view(*c.value_cache, 0);
  if (c.key_scale.has_value()) p.key_scale = mutable_layout_view(*c.key_scale, 0);
  if (c.value_scale.has_value()) p.value_scale = mutable_layout_view(*c.value_scale, 0);
}

}  // namespace opmesh::common
