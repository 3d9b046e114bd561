// The length arrays and block tables of the sequence operators (the indexer family, the sparse
// stage): their checks from dtypes and sizes, and their values on the host.
#include "sequence_args.h"

#include <ATen/ATen.h>

#include "checks.h"

namespace opmesh::binding {
namespace {

void check_int_tensor(const at::Tensor& t, const char* name, int64_t rank) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name,
                   ": expected int32 or int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == rank, name, ": expected a ", rank, "-D tensor, got shape ",
                    t.sizes());
}

}  // namespace

void check_per_sequence(const std::optional<at::Tensor>& t, const char* name,
                        const c10::SymInt& batch) {
  if (!t) return;
  check_int_tensor(*t, name, 1);
  TORCH_CHECK_VALUE(holds(t->sym_size(0) == batch), name, ": expected ", batch,
                    " entries (one per sequence), got ", t->sym_size(0));
}

c10::SymInt check_query_key_lengths(const at::Tensor& q, const std::optional<at::Tensor>& ql,
                                    const std::optional<at::Tensor>& kl,
                                    const std::optional<at::Tensor>& table, bool tnd, bool paged,
                                    const char* key_layout, const char* k_lens_name,
                                    std::string_view key_layout_value) {
  TORCH_CHECK_VALUE(!tnd || ql.has_value(),
                    "actual_seq_lengths_query: required for layout_query TND (cumulative lengths)");
  if (ql) check_int_tensor(*ql, "actual_seq_lengths_query", 1);
  const c10::SymInt batch = tnd ? ql->sym_size(0) : q.sym_size(0);
  if (!tnd && ql) {
    TORCH_CHECK_VALUE(holds(ql->sym_size(0) == batch), "actual_seq_lengths_query: expected ", batch,
                      " entries (one per batch), got ", ql->sym_size(0));
  }
  TORCH_CHECK_VALUE(!(tnd || paged) || kl.has_value(), k_lens_name, ": required for ", key_layout,
                    paged ? " PA_BSND (per-sequence lengths)" : " TND (cumulative lengths)");
  if (kl) {
    check_int_tensor(*kl, k_lens_name, 1);
    TORCH_CHECK_VALUE(holds(kl->sym_size(0) == batch), k_lens_name, ": expected ", batch,
                      " entries (one per sequence), got ", kl->sym_size(0));
  }
  if (paged) {
    TORCH_CHECK_VALUE(table.has_value(), "block_table: required for ", key_layout, " PA_BSND");
    check_int_tensor(*table, "block_table", 2);
    TORCH_CHECK_VALUE(holds(table->sym_size(0) == batch), "block_table: expected ", batch,
                      " rows (one per sequence), got shape ", table->sym_sizes());
  } else {
    TORCH_CHECK_VALUE(!table.has_value(), "block_table: only read with ", key_layout,
                      " PA_BSND, got ", key_layout, " '", key_layout_value, "'");
  }
  return batch;
}

}  // namespace opmesh::binding
