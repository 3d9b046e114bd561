// What every operator's checks and kernels in the torch binding use: the one translation of the
// core's errors into Python exceptions, and size relations that hold for symbolic sizes too.
#pragma once

#include <c10/core/SymBool.h>
#include <c10/core/SymInt.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <initializer_list>
#include <new>
#include <optional>
#include <utility>

#include "errors.h"

namespace opmesh::binding {

// Runs f, turning the core's ArgumentError (message starting with the argument) into ValueError.
template <class F>
auto rethrow(F&& f) {
  try {
    return f();
  } catch (const core::ArgumentError& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

// rethrow, and a failed allocation into OutOfMemoryError with the message oom_message() gives
// (starting with the argument whose size asked for the memory).
template <class F, class M>
auto rethrow(F&& f, M&& oom_message) {
  try {
    return rethrow(f);
  } catch (const std::bad_alloc&) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, oom_message());
  }
}

// A size relation: decided now for concrete sizes; for symbolic ones (torch.compile, export)
// recorded as a runtime assertion when it cannot be decided, so no size is specialised.
inline bool holds(const c10::SymBool& condition) {
  return condition.is_heap_allocated() ? condition.expect_true(__FILE__, __LINE__)
                                       : condition.guard_bool(__FILE__, __LINE__);
}

// flash-attn's logit soft-capping: a finite value >= 0 (0: none), for flash_attn and
// sparse_flash_attention alike.
inline void check_softcap(double softcap) {
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0.0,
                    "softcap: must be finite and >= 0 (0: no capping), got ", softcap);
}

// Head counts and head dims decide the kernel: they are specialised (guarded) when symbolic.
inline int64_t concrete(const c10::SymInt& size) { return size.guard_int(__FILE__, __LINE__); }

// Each tensor given (an optional one when present) on the device of `like`, named `like_name`:
// "NAME: expected a tensor on DEVICE like LIKE_NAME, got ...".
template <class Tensor>
void check_same_device(
    const Tensor& like, const char* like_name,
    std::initializer_list<std::pair<const Tensor*, const char*>> tensors,
    std::initializer_list<std::pair<const std::optional<Tensor>*, const char*>> optional = {}) {
  const auto check = [&](const Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.device() == like.device(), name, ": expected a tensor on ", like.device(),
                      " like ", like_name, ", got ", t.device());
  };
  for (const auto& [t, name] : tensors) check(*t, name);
  for (const auto& [t, name] : optional) {
    if (t->has_value()) check(**t, name);
  }
}

}  // namespace opmesh::binding
