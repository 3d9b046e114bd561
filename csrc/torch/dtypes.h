// Tensor dtype -> the core's element type, shared by every kernel of the binding.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "element_types.h"

namespace opmesh::binding {

// The floating types the kernels read; a TypeError naming `argument` otherwise.
inline core::DType to_core_dtype(at::ScalarType t, const char* argument) {
  static constexpr at::ScalarType kTags[] = {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble};
  const std::optional<core::DType> dtype = common::floating_dtype(t, kTags);
  TORCH_CHECK_TYPE(dtype.has_value(), argument,
                   ": expected float32, bfloat16, float16 or float64, got ", t);
  return *dtype;
}

// The quantized cache format a dtype stores (int8, float8_e4m3fn), else plain.
inline core::CacheFormat cache_format_of(at::ScalarType t) {
  return t == at::kChar            ? core::CacheFormat::kInt8
         : t == at::kFloat8_e4m3fn ? core::CacheFormat::kFp8E4M3
                                   : core::CacheFormat::kPlain;
}

}  // namespace opmesh::binding
