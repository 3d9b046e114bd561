// kv_cache_write_: CPU kernel (validate, then the core copy on PyTorch's pool) and Meta kernel
// (the same shape checks, nothing to write).
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "aten_executor.h"
#include "errors.h"
#include "kv_cache.h"

namespace opmesh::binding {
namespace {

void check_kv_cache_args(const at::Tensor& key, const at::Tensor& value,
                         const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const at::Tensor& slot_mapping) {
  for (const auto& [t, name] : {std::pair{&value, "value"},
                                {&key_cache, "key_cache"},
                                {&value_cache, "value_cache"},
                                {&slot_mapping, "slot_mapping"}}) {
    TORCH_CHECK_VALUE(t->device() == key.device(), name, ": expected a tensor on ", key.device(),
                      " like key, got ", t->device());
  }
  TORCH_CHECK_TYPE(key_cache.scalar_type() == key.scalar_type(), "key_cache: expected dtype ",
                   key.scalar_type(), " like key, got ", key_cache.scalar_type());
  TORCH_CHECK_TYPE(value.scalar_type() == key.scalar_type(), "value: expected dtype ",
                   key.scalar_type(), " like key, got ", value.scalar_type());
  TORCH_CHECK_TYPE(value_cache.scalar_type() == key.scalar_type(), "value_cache: expected dtype ",
                   key.scalar_type(), " like key, got ", value_cache.scalar_type());
  TORCH_CHECK_TYPE(
      slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong,
      "slot_mapping: expected int32 or int64, got ", slot_mapping.scalar_type());
  TORCH_CHECK_VALUE(key.dim() == 3, "key: expected [T, Nkv, D], got shape ", key.sizes());
  TORCH_CHECK_VALUE(value.dim() == 3, "value: expected [T, Nkv, Dv], got shape ", value.sizes());
  TORCH_CHECK_VALUE(key_cache.dim() == 4,
                    "key_cache: expected [num_blocks, block_size, Nkv, D], "
                    "got shape ",
                    key_cache.sizes());
  TORCH_CHECK_VALUE(value_cache.dim() == 4,
                    "value_cache: expected [num_blocks, block_size, Nkv, "
                    "Dv], got shape ",
                    value_cache.sizes());
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1, "slot_mapping: expected [T], got shape ",
                    slot_mapping.sizes());
  const auto t = key.sym_size(0);
  TORCH_CHECK_VALUE(value.sym_size(0) == t, "value: expected ", t, " tokens like key, got shape ",
                    value.sizes());
  TORCH_CHECK_VALUE(slot_mapping.sym_size(0) == t, "slot_mapping: expected ", t,
                    " entries (one per token of key), got shape ", slot_mapping.sizes());
  TORCH_CHECK_VALUE(value.sym_size(1) == key.sym_size(1), "value: ", value.sizes(),
                    " has other heads than key ", key.sizes());
  TORCH_CHECK_VALUE(
      key_cache.sym_size(2) == key.sym_size(1) && key_cache.sym_size(3) == key.sym_size(2),
      "key_cache: shape ", key_cache.sizes(), " does not hold key rows ", key.sizes());
  TORCH_CHECK_VALUE(value_cache.sym_size(0) == key_cache.sym_size(0) &&
                        value_cache.sym_size(1) == key_cache.sym_size(1) &&
                        value_cache.sym_size(2) == value.sym_size(1) &&
                        value_cache.sym_size(3) == value.sym_size(2),
                    "value_cache: shape ", value_cache.sizes(), " does not match key_cache ",
                    key_cache.sizes(), " and value rows ", value.sizes());
  TORCH_CHECK_VALUE(!key_cache.is_same(value_cache), "value_cache: must not be key_cache");
}

// In-place writes need memory no other argument shares, as PyTorch's own in-place ops require:
// otherwise what ends up in the cache depends on the order of the writes.
void check_no_overlap(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  for (const auto& [t, name] :
       {std::pair{&key_cache, "key_cache"}, {&value_cache, "value_cache"}}) {
    TORCH_CHECK_VALUE(at::has_internal_overlap(*t) != at::MemOverlap::Yes, name,
                      ": several elements share one memory location (an expanded tensor?); "
                      "an in-place write needs its own memory: pass a .clone()");
  }
  auto overlaps = [](const at::Tensor& a, const at::Tensor& b) {
    const at::MemOverlapStatus status = at::get_overlap_status(a, b);
    return status == at::MemOverlapStatus::Full || status == at::MemOverlapStatus::Partial;
  };
  TORCH_CHECK_VALUE(!overlaps(value_cache, key_cache),
                    "value_cache: shares memory with key_cache; the caches must not overlap");
  for (const auto& [t, name] :
       {std::pair{&key, "key"}, {&value, "value"}, {&slot_mapping, "slot_mapping"}}) {
    for (const auto& [cache, cache_name] :
         {std::pair{&key_cache, "key_cache"}, {&value_cache, "value_cache"}}) {
      TORCH_CHECK_VALUE(!overlaps(*t, *cache), name, ": shares memory with ", cache_name,
                        ", which the call writes; pass a .clone()");
    }
  }
}

void kv_cache_write_cpu(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(key.device().is_cpu(), "key: expected a CPU tensor, got ", key.device());
  check_kv_cache_args(key, value, key_cache, value_cache, slot_mapping);
  check_no_overlap(key, value, key_cache, value_cache, slot_mapping);
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  core::KvCacheWriteParams p;
  p.tokens = key.size(0);
  p.heads = key.size(1);
  p.dim_k = key.size(2);
  p.dim_v = value.size(2);
  p.elem_bytes = static_cast<int64_t>(key.element_size());
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  for (int i = 0; i < 3; ++i) {
    p.key_stride[i] = key.stride(i);
    p.value_stride[i] = value.stride(i);
  }
  for (int i = 0; i < 4; ++i) {
    p.key_cache_stride[i] = key_cache.stride(i);
    p.value_cache_stride[i] = value_cache.stride(i);
  }
  p.num_blocks = key_cache.size(0);
  p.block_size = key_cache.size(1);
  p.slots = slots.data_ptr<int64_t>();
  try {
    core::kv_cache_write(p, AtenExecutor());
  } catch (const core::ArgumentError& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

void kv_cache_write_meta(const at::Tensor& key, const at::Tensor& value,
                         const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const at::Tensor& slot_mapping) {
  check_kv_cache_args(key, value, key_cache, value_cache, slot_mapping);
}

// The caches are mutated: advance their version counters as PyTorch's own in-place ops do, so
// autograd notices a saved tensor that was overwritten. Runs above the backend kernel.
void kv_cache_write_inplace_or_view(const at::Tensor& key, const at::Tensor& value,
                                    const at::Tensor& key_cache, const at::Tensor& value_cache,
                                    const at::Tensor& slot_mapping) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("opmesh::kv_cache_write_", "")
                             .typed<decltype(kv_cache_write_cpu)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(key, value, key_cache, value_cache, slot_mapping);
  }
  key_cache.unsafeGetTensorImpl()->bump_version();
  value_cache.unsafeGetTensorImpl()->bump_version();
}

// The write has no derivative: with grad mode on, an argument that requires a gradient is
// refused here rather than cut silently out of the autograd graph.
void kv_cache_write_autograd(const at::Tensor& key, const at::Tensor& value,
                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& slot_mapping) {
  if (at::GradMode::is_enabled()) {
    for (const auto& [t, name] : {std::pair{&key, "key"},
                                  {&value, "value"},
                                  {&key_cache, "key_cache"},
                                  {&value_cache, "value_cache"}}) {
      TORCH_CHECK(!t->requires_grad(), "kv_cache_write_: ", name,
                  " requires a gradient, but writing into the cache has no backward; pass "
                  "detached tensors or call it under torch.no_grad()");
    }
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("opmesh::kv_cache_write_", "")
                             .typed<decltype(kv_cache_write_cpu)>();
  at::AutoDispatchBelowAutograd guard;
  op.call(key, value, key_cache, value_cache, slot_mapping);
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, CPU, m) { m.impl("kv_cache_write_", &kv_cache_write_cpu); }
TORCH_LIBRARY_IMPL(opmesh, Autograd, m) { m.impl("kv_cache_write_", &kv_cache_write_autograd); }
TORCH_LIBRARY_IMPL(opmesh, ADInplaceOrView, m) {
  m.impl("kv_cache_write_", &kv_cache_write_inplace_or_view);
}
TORCH_LIBRARY_IMPL(opmesh, Meta, m) { m.impl("kv_cache_write_", &kv_cache_write_meta); }

}  // namespace opmesh::binding
