// The torch binding's tensors as the code shared by the bindings reads them
// (csrc/common/tensor_access.h).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "dtypes.h"
#include "tensor_access.h"

namespace opmesh::common {

template <>
struct TensorAccess<at::Tensor> {
  static const void* data(const at::Tensor& t) { return t.data_ptr(); }
  static std::vector<int64_t> sizes(const at::Tensor& t) { return t.sizes().vec(); }
  static std::vector<int64_t> strides(const at::Tensor& t) { return t.strides().vec(); }
  static core::DType dtype(const at::Tensor& t, const char* argument) {
    return binding::to_core_dtype(t.scalar_type(), argument);
  }
  static int64_t element_size(const at::Tensor& t) {
    return static_cast<int64_t>(t.element_size());
  }
  static core::CacheFormat cache_format(const at::Tensor& t) {
    return binding::cache_format_of(t.scalar_type());
  }
};

// Integer tensors the kernels read on the host (lengths, block tables): int32 or int64, on any
// device whose memory the host can read.
template <>
struct HostIntsAccess<at::Tensor> {
  static std::vector<int64_t> values(const at::Tensor& t) {
    const at::Tensor host = t.to(at::kCPU, at::kLong).contiguous();
    return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
  }
  static int64_t columns(const at::Tensor& t) { return t.dim() == 2 ? t.size(1) : t.numel(); }
};

}  // namespace opmesh::common
