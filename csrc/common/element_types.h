// A framework's dtype as the core's element type, for every binding.
#pragma once

#include <optional>

#include "dtype.h"

namespace opmesh::common {

// The core's floating type of a framework's dtype `tag`, given that framework's tags for
// float32, bfloat16, float16 and float64 (core::DType's order); nullopt for any other dtype.
template <class Tag>
std::optional<core::DType> floating_dtype(Tag tag, const Tag (&tags)[4]) {
  for (int i = 0; i < 4; ++i) {
    if (tags[i] == tag) return static_cast<core::DType>(i);
  }
  return std::nullopt;
}

}  // namespace opmesh::common
