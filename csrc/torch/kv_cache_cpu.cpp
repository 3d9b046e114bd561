// kv_cache_write_: CPU kernel (validate, then the core copy on PyTorch's pool) and Meta kernel
// (the same shape checks, nothing to write).
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "aten_executor.h"
#include "cache_params.h"
#include "checks.h"
#include "dtypes.h"
#include "kv_cache.h"
#include "op_call.h"
#include "torch_access.h"

namespace opmesh::binding {
namespace {

bool quantized(const KvCacheWriteCall& a) {
  return cache_format_of(a.key_cache.scalar_type()) != core::CacheFormat::kPlain;
}

// A quantized cache's scales: float32 [num_blocks, block_size, Nkv] beside it, and caches of
// unit stride along the head dim; none otherwise (and no value_scale for a shared key/value
// cache). Runs after the caches' shapes are checked.
void check_scales(const KvCacheWriteCall& a) {
  if (!a.value_cache.has_value()) {
    TORCH_CHECK_VALUE(!a.value_scale.has_value(),
                      "value_scale: given without value_cache (a shared key/value cache has one "
                      "scale per row: key_scale)");
  }
  if (!quantized(a)) {
    for (const auto& [t, name] :
         {std::pair{&a.key_scale, "key_scale"}, {&a.value_scale, "value_scale"}}) {
      TORCH_CHECK_VALUE(!t->has_value(), name, ": given, but key_cache is ",
                        a.key_cache.scalar_type(),
                        ", not a quantized cache (int8 or float8_e4m3fn) that needs row scales");
    }
    return;
  }
  check_row_scales(a.key_scale, "key_scale", a.key_cache, "key_cache", a.key.device());
  if (a.value_cache.has_value()) {
    check_row_scales(a.value_scale, "value_scale", *a.value_cache, "value_cache", a.key.device());
  }
}

void check_kv_cache_args(const KvCacheWriteCall& a) {
  // value and value_cache come together: both given, or neither (a shared key/value cache).
  TORCH_CHECK_VALUE(
      a.value.has_value() == a.value_cache.has_value(),
      a.value.has_value() ? "value_cache: required with value" : "value: required with value_cache",
      "; pass both, or neither for one cache of rows read as key and value");
  for (const auto& [t, name] :
       {std::pair{&a.key_cache, "key_cache"}, {&a.slot_mapping, "slot_mapping"}}) {
    TORCH_CHECK_VALUE(t->device() == a.key.device(), name, ": expected a tensor on ",
                      a.key.device(), " like key, got ", t->device());
  }
  for (const auto& [t, name] : {std::pair{&a.value, "value"}, {&a.value_cache, "value_cache"}}) {
    if (!t->has_value()) continue;
    TORCH_CHECK_VALUE((*t)->device() == a.key.device(), name, ": expected a tensor on ",
                      a.key.device(), " like key, got ", (*t)->device());
  }
  if (quantized(a)) {
    to_core_dtype(a.key.scalar_type(), "key");
  } else {
    TORCH_CHECK_TYPE(a.key_cache.scalar_type() == a.key.scalar_type(), "key_cache: expected dtype ",
                     a.key.scalar_type(),
                     " like key (or int8 / float8_e4m3fn, a quantized cache), got ",
                     a.key_cache.scalar_type());
  }
  TORCH_CHECK_TYPE(
      a.slot_mapping.scalar_type() == at::kInt || a.slot_mapping.scalar_type() == at::kLong,
      "slot_mapping: expected int32 or int64, got ", a.slot_mapping.scalar_type());
  TORCH_CHECK_VALUE(a.key.dim() == 3, "key: expected [T, Nkv, D], got shape ", a.key.sizes());
  TORCH_CHECK_VALUE(a.key_cache.dim() == 4,
                    "key_cache: expected [num_blocks, block_size, Nkv, D], got shape ",
                    a.key_cache.sizes());
  TORCH_CHECK_VALUE(a.slot_mapping.dim() == 1, "slot_mapping: expected [T], got shape ",
                    a.slot_mapping.sizes());
  const auto t = a.key.sym_size(0);
  TORCH_CHECK_VALUE(a.slot_mapping.sym_size(0) == t, "slot_mapping: expected ", t,
                    " entries (one per token of key), got shape ", a.slot_mapping.sizes());
  TORCH_CHECK_VALUE(
      a.key_cache.sym_size(2) == a.key.sym_size(1) && a.key_cache.sym_size(3) == a.key.sym_size(2),
      "key_cache: shape ", a.key_cache.sizes(), " does not hold key rows ", a.key.sizes());
  if (!a.value.has_value()) return check_scales(a);
  const at::Tensor& value = *a.value;
  const at::Tensor& value_cache = *a.value_cache;
  TORCH_CHECK_TYPE(value.scalar_type() == a.key.scalar_type(), "value: expected dtype ",
                   a.key.scalar_type(), " like key, got ", value.scalar_type());
  TORCH_CHECK_TYPE(value_cache.scalar_type() == a.key_cache.scalar_type(),
                   "value_cache: expected dtype ", a.key_cache.scalar_type(),
                   " like key_cache, got ", value_cache.scalar_type());
  TORCH_CHECK_VALUE(value.dim() == 3, "value: expected [T, Nkv, Dv], got shape ", value.sizes());
  TORCH_CHECK_VALUE(value_cache.dim() == 4,
                    "value_cache: expected [num_blocks, block_size, Nkv, Dv], got shape ",
                    value_cache.sizes());
  TORCH_CHECK_VALUE(value.sym_size(0) == t, "value: expected ", t, " tokens like key, got shape ",
                    value.sizes());
  TORCH_CHECK_VALUE(value.sym_size(1) == a.key.sym_size(1), "value: ", value.sizes(),
                    " has other heads than key ", a.key.sizes());
  TORCH_CHECK_VALUE(value_cache.sym_size(0) == a.key_cache.sym_size(0) &&
                        value_cache.sym_size(1) == a.key_cache.sym_size(1) &&
                        value_cache.sym_size(2) == value.sym_size(1) &&
                        value_cache.sym_size(3) == value.sym_size(2),
                    "value_cache: shape ", value_cache.sizes(), " does not match key_cache ",
                    a.key_cache.sizes(), " and value rows ", value.sizes());
  TORCH_CHECK_VALUE(!a.key_cache.is_same(value_cache),
                    "value_cache: must not be key_cache (for one cache of rows read as key and "
                    "value, pass value=None and value_cache=None)");
  check_scales(a);
}

// In-place writes need memory no other argument shares, as PyTorch's own in-place ops require:
// otherwise what ends up in the cache depends on the order of the writes.
void check_no_overlap(const KvCacheWriteCall& a) {
  std::vector<std::pair<const at::Tensor*, const char*>> written = {{&a.key_cache, "key_cache"}};
  if (a.value_cache.has_value()) written.emplace_back(&*a.value_cache, "value_cache");
  if (a.key_scale.has_value()) written.emplace_back(&*a.key_scale, "key_scale");
  if (a.value_scale.has_value()) written.emplace_back(&*a.value_scale, "value_scale");
  for (const auto& [t, name] : written) {
    TORCH_CHECK_VALUE(at::has_internal_overlap(*t) != at::MemOverlap::Yes, name,
                      ": several elements share one memory location (an expanded tensor?); "
                      "an in-place write needs its own memory: pass a .clone()");
  }
  auto overlaps = [](const at::Tensor& a, const at::Tensor& b) {
    const at::MemOverlapStatus status = at::get_overlap_status(a, b);
    return status == at::MemOverlapStatus::Full || status == at::MemOverlapStatus::Partial;
  };
  // Each written tensor against those before it, then every read one against each written one.
  for (size_t i = 1; i < written.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      TORCH_CHECK_VALUE(!overlaps(*written[i].first, *written[j].first), written[i].second,
                        ": shares memory with ", written[j].second,
                        "; the written tensors must not overlap");
    }
  }
  std::vector<std::pair<const at::Tensor*, const char*>> read = {{&a.key, "key"},
                                                                 {&a.slot_mapping, "slot_mapping"}};
  if (a.value.has_value()) read.emplace_back(&*a.value, "value");
  for (const auto& [t, name] : read) {
    for (const auto& [cache, cache_name] : written) {
      TORCH_CHECK_VALUE(!overlaps(*t, *cache), name, ": shares memory with ", cache_name,
                        ", which the call writes; pass a .clone()");
    }
  }
}

void kv_cache_write_cpu(const KvCacheWriteCall& a) {
  TORCH_CHECK_VALUE(a.key.device().is_cpu(), "key: expected a CPU tensor, got ", a.key.device());
  check_kv_cache_args(a);
  check_no_overlap(a);
  const std::vector<int64_t> slots = common::HostIntsAccess<at::Tensor>::values(a.slot_mapping);
  core::KvCacheWriteParams p = common::kv_cache_params(a, slots);
  common::point_kv_cache(p, a);
  rethrow([&] { cpu_kernels().kv_cache_write(p, AtenExecutor()); });
}

void kv_cache_write_meta(const KvCacheWriteCall& a) { check_kv_cache_args(a); }

// The caches are mutated: advance their version counters as PyTorch's own in-place ops do, so
// autograd notices a saved tensor that was overwritten. Runs above the backend kernel.
void kv_cache_write_inplace_or_view(const KvCacheWriteCall& a) {
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    call_op(a);
  }
  a.key_cache.unsafeGetTensorImpl()->bump_version();
  if (a.value_cache.has_value()) a.value_cache->unsafeGetTensorImpl()->bump_version();
  if (a.key_scale.has_value()) a.key_scale->unsafeGetTensorImpl()->bump_version();
  if (a.value_scale.has_value()) a.value_scale->unsafeGetTensorImpl()->bump_version();
}

// The write has no derivative: with grad mode on, an argument that requires a gradient is
// refused here rather than cut silently out of the autograd graph.
void kv_cache_write_autograd(const KvCacheWriteCall& a) {
  if (at::GradMode::is_enabled()) {
    for (const auto& [t, name] : {std::pair{&a.key, "key"}, {&a.key_cache, "key_cache"}}) {
      TORCH_CHECK(!t->requires_grad(), "kv_cache_write_: ", name,
                  " requires a gradient, but writing into the cache has no backward; pass "
                  "detached tensors or call it under torch.no_grad()");
    }
    for (const auto& [t, name] : {std::pair{&a.value, "value"},
                                  {&a.value_cache, "value_cache"},
                                  {&a.key_scale, "key_scale"},
                                  {&a.value_scale, "value_scale"}}) {
      TORCH_CHECK(!(t->has_value() && (*t)->requires_grad()), "kv_cache_write_: ", name,
                  " requires a gradient, but writing into the cache has no backward; pass "
                  "detached tensors or call it under torch.no_grad()");
    }
  }
  at::AutoDispatchBelowAutograd guard;
  call_op(a);
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, CPU, m) { impl<KvCacheWriteCall, kv_cache_write_cpu>(m); }
TORCH_LIBRARY_IMPL(opmesh, Autograd, m) { impl<KvCacheWriteCall, kv_cache_write_autograd>(m); }
TORCH_LIBRARY_IMPL(opmesh, ADInplaceOrView, m) {
  impl<KvCacheWriteCall, kv_cache_write_inplace_or_view>(m);
}
TORCH_LIBRARY_IMPL(opmesh, Meta, m) { impl<KvCacheWriteCall, kv_cache_write_meta>(m); }

}  // namespace opmesh::binding
