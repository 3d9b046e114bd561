// lightning_indexer's argument checks, shared by its CPU and Meta kernels: everything devices,
// dtypes, ranks, sizes and argument values decide without reading tensor data (the length
// arrays' and block table's values are checked by the core).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>
#include <tuple>

#include "checks.h"
#include "conventions.h"
#include "op_call.h"
#include "sequence_args.h"
#include "vocabulary.h"

namespace opmesh::binding {

struct LightningIndexerArgs {
  core::Layout layout_query = core::Layout::kBSND;
  core::Layout layout_key = core::Layout::kBSND;
  bool tnd = false;    // layout_query TND
  bool paged = false;  // layout_key PA_BSND
  int64_t n1 = 0, n2 = 0, d = 0;
  bool no_heads = false;  // N1 = N2 = 0: no rows, empty outputs, the core not called
  c10::SymInt batch;      // B, or the query lengths' entries for TND
};

LightningIndexerArgs check_lightning_indexer_args(const LightningIndexerCall& call);

// Query heads n1 in [1, kMaxHeads] and key heads n2 dividing them (unless there are none of
// either), head dim d in [1, kMaxHeadDim], the key's (its last size) equal to it.
void check_heads(const at::Tensor& q, const at::Tensor& k, int64_t n1, int64_t n2, int64_t d,
                 bool no_heads);

// Uninitialised outputs: sparse_indices int32 [B, S1, N2, K] / [T1, N2, K], and sparse_values
// float32 of the same shape when return_value, else an empty tensor.
std::tuple<at::Tensor, at::Tensor> lightning_indexer_outputs(const LightningIndexerCall& call,
                                                             const LightningIndexerArgs& args);

}  // namespace opmesh::binding
