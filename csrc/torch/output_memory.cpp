#include "output_memory.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace opmesh::binding {
namespace {

// OPMESH_HUGE_PAGES: on (the default, also when unset or empty) or off.
bool huge_pages_allowed() {
  const char* env = std::getenv("OPMESH_HUGE_PAGES");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "on") == 0) return true;
  if (std::strcmp(env, "off") == 0) return false;
  TORCH_CHECK_VALUE(false, "OPMESH_HUGE_PAGES: expected on or off, got '", env, "'");
  return false;
}

}  // namespace

const at::Tensor& advise_huge_pages(const at::Tensor& t) {
  if (!huge_pages_allowed() || !t.defined() || !t.device().is_cpu() ||
      static_cast<int64_t>(t.nbytes()) < kHugePageOutputBytes) {
    return t;
  }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (begin + t.nbytes()) & ~(kHuge - 1);
  // Advice only: where the kernel has no transparent huge pages the call fails and the pages
  // stay as they were.
  if (last > first) (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
  return t;
}

at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  advise_huge_pages(t);
  return t;
}

}  // namespace opmesh::binding
