// Argument handling shared by the CPU and Meta kernels of flash_attn and flash_attn_metadata:
// everything that can be decided from ranks, sizes and argument values without reading data.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string_view>
#include <utility>

#include "attention/config.h"

namespace opmesh::binding {

namespace attn = core::attention;

inline attn::Layout parse_layout(std::string_view s, const char* name) {
  if (s == "BSND") return attn::Layout::kBSND;
  if (s == "BNSD") return attn::Layout::kBNSD;
  if (s == "TND") return attn::Layout::kTND;
  if (s == "PA_BBND") return attn::Layout::kPagedBBND;
  TORCH_CHECK_VALUE(false, name, ": expected 'BSND', 'BNSD', 'TND' or 'PA_BBND', got '", s, "'");
}

// Positions of the batch, sequence, head and dim axes of a q/k/v tensor in `layout`
// (-1: absent). Paged caches read as [block][slot][head][dim].
struct Axes {
  int b, s, n, d;
  int rank;
};

inline Axes axes_of(attn::Layout layout) {
  switch (layout) {
    case attn::Layout::kBSND:
    case attn::Layout::kPagedBBND:
      return {0, 1, 2, 3, 4};
    case attn::Layout::kBNSD:
      return {0, 2, 1, 3, 4};
    case attn::Layout::kTND:
      return {-1, 0, 1, 2, 3};
  }
  return {0, 1, 2, 3, 4};
}

inline void check_rank(const at::Tensor& t, attn::Layout layout, const char* name) {
  const Axes a = axes_of(layout);
  TORCH_CHECK_VALUE(t.dim() == a.rank, name, ": expected a ", a.rank, "-D ",
                    attn::layout_name(layout), " tensor, got ", t.dim(), "-D with shape ",
                    t.sizes());
}

// Every tensor argument on q's device (the metadata and length arrays are read on the host and
// are checked where they are read).
inline void check_devices(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& block_table,
                          const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK_VALUE(k.device() == q.device(), "k: expected a tensor on ", q.device(),
                    " like q, got ", k.device());
  TORCH_CHECK_VALUE(v.device() == q.device(), "v: expected a tensor on ", q.device(),
                    " like q, got ", v.device());
  for (const auto& [t, name] : {std::pair{&block_table, "block_table"}, {&sinks, "sinks"}}) {
    if (t->has_value()) {
      TORCH_CHECK_VALUE((*t)->device() == q.device(), name, ": expected a tensor on ", q.device(),
                        " like q, got ", (*t)->device());
    }
  }
}

}  // namespace opmesh::binding
