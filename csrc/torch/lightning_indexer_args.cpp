// Argument checks of lightning_indexer shared by its CPU and Meta kernels, and its outputs.
#include "lightning_indexer_args.h"

#include <ATen/ATen.h>

#include "checks.h"
#include "dtypes.h"
#include "indexer/lightning_indexer.h"
#include "output_memory.h"

namespace opmesh::binding {
void check_heads(const at::Tensor& q, const at::Tensor& k, int64_t n1, int64_t n2, int64_t d,
                 bool no_heads) {
  TORCH_CHECK_VALUE(no_heads || (n1 >= 1 && n1 <= core::kMaxHeads), "query: N1 must be in [1, ",
                    core::kMaxHeads, "], got shape ", q.sym_sizes());
  TORCH_CHECK_VALUE(no_heads || (n2 >= 1 && n1 % n2 == 0), "key: key heads N2=", n2,
                    " must divide the query heads N1=", n1);
  TORCH_CHECK_VALUE(d >= 1 && d <= core::kMaxHeadDim, "query: head dim D must be in [1, ",
                    core::kMaxHeadDim, "], got shape ", q.sym_sizes());
  TORCH_CHECK_VALUE(concrete(k.sym_size(-1)) == d, "key: head dim ", k.sym_size(-1),
                    " differs from query's ", d);
}

LightningIndexerArgs check_lightning_indexer_args(const LightningIndexerCall& a) {
  const at::Tensor& q = a.query;
  const at::Tensor& k = a.key;
  const at::Tensor& w = a.weights;
  check_same_device(q, "query", {{&k, "key"}, {&w, "weights"}},
                    {{&a.actual_seq_lengths_query, "actual_seq_lengths_query"},
                     {&a.actual_seq_lengths_key, "actual_seq_lengths_key"},
                     {&a.block_table, "block_table"},
                     {&a.cmp_residual_key, "cmp_residual_key"}});
  to_core_dtype(q.scalar_type(), "query");
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type(), "key: expected dtype ", q.scalar_type(),
                   " like query, got ", k.scalar_type());
  TORCH_CHECK_TYPE(w.scalar_type() == q.scalar_type() || w.scalar_type() == at::kFloat,
                   "weights: expected dtype ", q.scalar_type(), " or float32, got ",
                   w.scalar_type());

  LightningIndexerArgs r;
  r.layout_query =
      rethrow([&] { return conventions::indexer_layout(a.layout_query, "layout_query"); });
  r.layout_key = rethrow([&] { return conventions::indexer_key_layout(a.layout_key); });
  r.paged = r.layout_key == core::Layout::kPagedBBND;
  r.tnd = r.layout_query == core::Layout::kTND;
  TORCH_CHECK_VALUE(r.paged || r.layout_key == r.layout_query, "layout_key: expected '",
                    a.layout_query, "' like layout_query, or 'PA_BSND', got '", a.layout_key, "'");
  rethrow([&] { return conventions::indexer_mask(a.sparse_mode, a.pre_tokens, a.next_tokens); });
  TORCH_CHECK_VALUE(a.sparse_count >= 1 && a.sparse_count <= core::kMaxSparseCount,
                    "sparse_count: must be in [1, ", core::kMaxSparseCount, "], got ",
                    a.sparse_count);

  const int64_t q_rank = r.tnd ? 3 : 4;
  const int64_t k_rank = r.paged ? 4 : q_rank;
  const char* q_name = r.tnd ? "TND" : "BSND";
  TORCH_CHECK_VALUE(q.dim() == q_rank, "query: expected a ", q_rank, "-D ", q_name,
                    " tensor, got shape ", q.sizes());
  TORCH_CHECK_VALUE(k.dim() == k_rank, "key: expected a ", k_rank, "-D ",
                    r.paged ? "PA_BSND" : q_name, " tensor, got shape ", k.sizes());
  TORCH_CHECK_VALUE(w.dim() == q_rank - 1, "weights: expected a ", q_rank - 1,
                    "-D tensor for layout_query ", q_name, ", got shape ", w.sizes());
  const int64_t qoff = r.tnd ? -1 : 0;
  const int64_t koff = r.paged ? 0 : qoff;
  r.n1 = concrete(q.sym_size(2 + qoff));
  r.n2 = concrete(k.sym_size(2 + koff));
  r.d = concrete(q.sym_size(3 + qoff));
  r.no_heads = r.n1 == 0 && r.n2 == 0;
  check_heads(q, k, r.n1, r.n2, r.d, r.no_heads);
  for (int64_t dim = 0; dim < w.dim(); ++dim) {
    TORCH_CHECK_VALUE(holds(w.sym_size(dim) == q.sym_size(dim)), "weights: expected shape ",
                      q.sym_sizes().slice(0, w.dim()), " (query without D), got ", w.sym_sizes());
  }
  if (!r.tnd && !r.paged) {
    TORCH_CHECK_VALUE(holds(k.sym_size(0) == q.sym_size(0)), "key: batch ", k.sym_size(0),
                      " differs from query's ", q.sym_size(0));
  }

  r.batch = check_query_key_lengths(q, a.actual_seq_lengths_query, a.actual_seq_lengths_key,
                                    a.block_table, r.tnd, r.paged, "layout_key",
                                    "actual_seq_lengths_key", a.layout_key);
  check_per_sequence(a.cmp_residual_key, "cmp_residual_key", r.batch);
  return r;
}

std::tuple<at::Tensor, at::Tensor> lightning_indexer_outputs(const LightningIndexerCall& a,
                                                             const LightningIndexerArgs& r) {
  std::vector<c10::SymInt> shape;
  if (r.tnd) {
    shape = {a.query.sym_size(0), c10::SymInt(r.n2), c10::SymInt(a.sparse_count)};
  } else {
    shape = {a.query.sym_size(0), a.query.sym_size(1), c10::SymInt(r.n2),
             c10::SymInt(a.sparse_count)};
  }
  const auto options = a.query.options();
  at::Tensor indices = at::empty_symint(shape, options.dtype(at::kInt));
  at::Tensor values = a.return_value ? at::empty_symint(shape, options.dtype(at::kFloat))
                                     : at::empty({0}, options.dtype(at::kFloat));
  advise_huge_pages(indices);
  advise_huge_pages(values);
  return {indices, values};
}

}  // namespace opmesh::binding
