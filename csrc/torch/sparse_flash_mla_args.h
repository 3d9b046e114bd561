// sparse_flash_mla's argument checks, shared by the CPU and Meta kernels of the forward and the
// backward: devices, dtypes, ranks and shapes (values are the core's: csrc/core/attention).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include "op_call.h"

namespace opmesh::binding {

struct MlaArgs {
  bool tnd = false;
  bool paged = false;
  int64_t n1 = 0, n2 = 0, d = 0;
  bool no_heads = false;  // N1 = 0: nothing to compute
};

template <class Call>
MlaArgs check_sparse_flash_mla_args(const Call& call);

// The forward's outputs: attention_out like q, and softmax_lse float32 [B, N2, S1, G] /
// [N2, T1, G], or a float32 scalar 0 without return_lse.
std::tuple<at::Tensor, at::Tensor> sparse_flash_mla_outputs(const at::Tensor& q, const MlaArgs& a,
                                                            bool return_lse);

}  // namespace opmesh::binding
