// Tensor dtype -> the core's element type, shared by every kernel of the binding.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "checks.h"
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

// The row scales of a quantized tensor `rows` (`rows_name`, int8 / float8_e4m3fn): required,
// float32 on `device`, shaped as rows without its head dim (one scale per row and head), and rows
// of unit stride along that dim. Every operator that reads a quantized cache checks its scales
// here.
inline void check_row_scales(const std::optional<at::Tensor>& scale, const char* name,
                             const at::Tensor& rows, const char* rows_name,
                             const at::Device& device) {
  TORCH_CHECK_VALUE(scale.has_value(), name, ": required with a quantized ", rows_name, " (",
                    rows.scalar_type(), "): float32, one scale per row and head");
  TORCH_CHECK_VALUE(scale->device() == device, name, ": expected a tensor on ", device, ", got ",
                    scale->device());
  TORCH_CHECK_TYPE(scale->scalar_type() == at::kFloat, name, ": expected float32, got ",
                   scale->scalar_type());
  const auto want = rows.sym_sizes().slice(0, rows.dim() - 1);
  TORCH_CHECK_VALUE(scale->sym_sizes() == want, name, ": expected shape ", want, " (", rows_name,
                    "'s shape without its head dim: one scale per row and head), got ",
                    scale->sym_sizes());
  TORCH_CHECK_VALUE(holds(rows.sym_stride(-1) == 1), rows_name,
                    ": a quantized tensor needs unit stride along its head dim, got strides ",
                    rows.sym_strides());
}

}  // namespace opmesh::binding
