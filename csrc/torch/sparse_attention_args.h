// sparse_flash_attention's argument checks, shared by the CPU and Meta kernels of the forward and
// the backward, and the core's params from checked tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>
#include <vector>

#include "attention/sparse_attention.h"
#include "checks.h"
#include "conventions.h"
#include "op_call.h"
#include "sequence_args.h"
#include "vocabulary.h"

namespace opmesh::binding {

struct SparseAttnArgs {
  core::Layout layout_query = core::Layout::kBSND;
  core::Layout layout_kv = core::Layout::kBSND;
  bool tnd = false;
  bool paged = false;
  int64_t n1 = 0, n2 = 0, d = 0, dr = 0, dv = 0, index_heads = 1, k = 0;
  bool no_heads = false;  // N1 = N2 = 0
};

// The checks in order: devices, dtypes, layouts and ranks, shapes, argument values. The
// backward's call passes its forward arguments through the same struct fields.
template <class Call>
SparseAttnArgs check_sparse_attention_args(const Call& call);

// The forward's outputs: attention_out (query's leading dims, N1, Dv; query's dtype) and the
// statistics float32 [B, N2, S1, G] / [N2, T1, G], or empty tensors without return_lse.
std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attention_outputs(const at::Tensor& query,
                                                                        const SparseAttnArgs& a,
                                                                        bool return_lse);

}  // namespace opmesh::binding
