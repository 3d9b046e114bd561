// CPU kernel of lightning_indexer: checks, the core's params from the tensors, the core on
// PyTorch's thread pool.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "aten_executor.h"
#include "dtypes.h"
#include "indexer/lightning_indexer.h"
#include "indexer_checks.h"
#include "lightning_indexer_args.h"

namespace opmesh::binding {
namespace {

Outputs2 lightning_indexer_cpu(const LightningIndexerCall& a) {
  const at::Tensor& q = a.query;
  const at::Tensor& k = a.key;
  const at::Tensor& w = a.weights;
  TORCH_CHECK_VALUE(q.device().is_cpu(), "query: expected a CPU tensor, got ", q.device());
  const LightningIndexerArgs r = check_lightning_indexer_args(a);
  auto [indices, values] = lightning_indexer_outputs(a, r);
  const std::vector<int64_t> qlens = read_lengths(a.actual_seq_lengths_query);
  const std::vector<int64_t> klens = read_lengths(a.actual_seq_lengths_key);
  std::vector<int64_t> table;
  if (r.paged) {
    const at::Tensor host = a.block_table->to(at::kLong).contiguous();
    table.assign(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
  }

  core::LightningIndexerParams p;
  p.layout_query = r.layout_query;
  p.layout_key = r.layout_key;
  p.sparse_mode = static_cast<core::MaskMode>(a.sparse_mode);  // checked above
  p.pre_tokens = a.pre_tokens;
  p.next_tokens = a.next_tokens;
  const int64_t qoff = r.tnd ? -1 : 0;
  const int64_t koff = r.paged ? 0 : qoff;
  p.batch = r.tnd ? static_cast<int64_t>(qlens.size()) : q.size(0);
  p.seq_q = q.size(1 + qoff);
  p.seq_k = r.paged ? 0 : k.size(1 + koff);
  p.heads_q = r.n1;
  p.heads_k = r.n2;
  p.head_dim = r.d;
  p.sparse_count = a.sparse_count;
  p.qk_dtype = to_core_dtype(q.scalar_type(), "query");
  p.weights_dtype = to_core_dtype(w.scalar_type(), "weights");
  p.query = q.data_ptr();
  p.key = k.data_ptr();
  p.weights = w.data_ptr();
  for (int64_t i = 0; i < 4; ++i) {
    p.query_stride[i] = i + qoff >= 0 ? q.stride(i + qoff) : 0;
    p.key_stride[i] = i + koff >= 0 ? k.stride(i + koff) : 0;
  }
  for (int64_t i = 0; i < 3; ++i) p.weights_stride[i] = i + qoff >= 0 ? w.stride(i + qoff) : 0;
  p.seq_q_lens = qlens.empty() ? nullptr : qlens.data();
  p.seq_k_lens = klens.empty() ? nullptr : klens.data();
  if (r.paged) {
    p.block_table = table.data();
    p.max_blocks = a.block_table->size(1);
    p.block_size = k.size(1);
    p.block_count = k.size(0);
  }
  p.indices = indices.data_ptr<int32_t>();
  p.values = a.return_value ? values.data_ptr<float>() : nullptr;
  rethrow(
      [&] {
        if (r.no_heads) {
          // No rows: nothing to compute; lengths, block table and band are still checked.
          p.heads_q = p.heads_k = 1;
          core::validate(p);
          return;
        }
        core::lightning_indexer(p, AtenExecutor(), core::active_isa());
      },
      [&] {
        return c10::str("sparse_count: the candidate buffers for K=", a.sparse_count,
                        " could not be allocated");
      });
  return {indices, values};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, CPU, m) { impl<LightningIndexerCall, lightning_indexer_cpu>(m); }

}  // namespace opmesh::binding
