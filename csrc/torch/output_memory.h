// Memory of the CPU kernels' outputs. A large output is fresh memory that the kernel's first
// writes fault in page by page; advised for transparent huge pages, it faults in 2 MiB at a time
// (OPMESH_HUGE_PAGES=off keeps the kernel's default).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>

namespace opmesh::binding {

// Outputs from this many bytes on are advised (16 huge pages).
inline constexpr int64_t kHugePageOutputBytes = int64_t{32} << 20;

// Advises the whole 2 MiB pages inside t's bytes for transparent huge pages (MADV_HUGEPAGE) when
// t is a CPU tensor of at least kHugePageOutputBytes and OPMESH_HUGE_PAGES allows it; call it
// before anything writes t. Returns t.
const at::Tensor& advise_huge_pages(const at::Tensor& t);

// at::empty(sizes, options), advised as above.
at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace opmesh::binding
