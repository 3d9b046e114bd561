// The length arrays and block tables of the sequence operators (the indexer family, the sparse
// stage): their checks from dtypes and sizes, and their values on the host.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>
#include <string_view>
#include <vector>

namespace opmesh::binding {

// The sparse stage's length arrays and block table (lightning_indexer, sparse_flash_attention):
// dtype, rank and entry counts; `key_layout` and `k_lens_name` are the op's names for the key
// layout argument and the key lengths. Returns the number of sequences (B, or the query lengths'
// entries for TND).
// An optional integer tensor of one entry per sequence (int32 or int64, 1-D, `batch` entries).
void check_per_sequence(const std::optional<at::Tensor>& t, const char* name,
                        const c10::SymInt& batch);

c10::SymInt check_query_key_lengths(const at::Tensor& query,
                                    const std::optional<at::Tensor>& q_lens,
                                    const std::optional<at::Tensor>& k_lens,
                                    const std::optional<at::Tensor>& block_table, bool tnd,
                                    bool paged, const char* key_layout, const char* k_lens_name,
                                    std::string_view key_layout_value);

}  // namespace opmesh::binding
