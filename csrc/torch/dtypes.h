// Tensor dtype -> the core's element type, shared by every kernel of the binding.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "dtype.h"

namespace opmesh::binding {

// The floating types the kernels read; a TypeError naming `argument` otherwise.
inline core::DType to_core_dtype(at::ScalarType t, const char* argument) {
  switch (t) {
    case at::kFloat:
      return core::DType::kFloat32;
    case at::kBFloat16:
      return core::DType::kBFloat16;
    case at::kHalf:
      return core::DType::kFloat16;
    case at::kDouble:
      return core::DType::kFloat64;
    default:
      TORCH_CHECK_TYPE(false, argument, ": expected float32, bfloat16, float16 or float64, got ",
                       t);
  }
}

}  // namespace opmesh::binding
