// lightning_indexer on MindSpore tensors: the shapes were checked by the shared torch shape
// function in Python; the core checks the host values (lengths, block table) and computes.
#include <memory>
#include <vector>

#include "conventions.h"
#include "cpu_features.h"
#include "indexer/lightning_indexer.h"
#include "ms_call.h"

namespace opmesh::ms_binding {

py::object lightning_indexer(const LightningIndexerCall& call) {
  resolve({&call.query, &call.key, &call.weights});
  core::LightningIndexerParams base;
  base.layout_query =
      checked([&] { return conventions::indexer_layout(call.layout_query, "layout_query"); });
  base.layout_key = checked([&] { return conventions::indexer_key_layout(call.layout_key); });
  base.sparse_mode = checked([&] { return conventions::sparse_mode(call.sparse_mode); });
  base.pre_tokens = call.pre_tokens;
  base.next_tokens = call.next_tokens;
  base.sparse_count = call.sparse_count;
  const bool tnd = base.layout_query == core::Layout::kTND;
  const bool paged = base.layout_key == core::Layout::kPagedBBND;
  const size_t rank = tnd ? 3 : 4;
  require_rank(call.query, rank, "query");
  require_rank(call.key, paged ? 4 : rank, "key");
  require_rank(call.weights, rank - 1, "weights");
  const int qoff = tnd ? -1 : 0;
  const int koff = paged ? 0 : qoff;
  auto qlens = std::make_shared<std::vector<int64_t>>(call.actual_seq_lengths_query
                                                          ? call.actual_seq_lengths_query->values
                                                          : std::vector<int64_t>{});
  auto klens = std::make_shared<std::vector<int64_t>>(
      call.actual_seq_lengths_key ? call.actual_seq_lengths_key->values : std::vector<int64_t>{});
  auto table = std::make_shared<std::vector<int64_t>>(call.block_table ? call.block_table->values
                                                                       : std::vector<int64_t>{});
  const std::vector<int64_t> qs = call.query.shape();
  const std::vector<int64_t> ks = call.key.shape();
  base.batch = tnd ? static_cast<int64_t>(qlens->size()) : qs[0];
  base.seq_q = qs[1 + qoff];
  base.seq_k = paged ? 0 : ks[1 + koff];
  base.heads_q = qs[2 + qoff];
  base.heads_k = ks[2 + koff];
  base.head_dim = qs[3 + qoff];
  base.qk_dtype = core_dtype(call.query, "query");
  base.weights_dtype = core_dtype(call.weights, "weights");
  if (paged) {
    base.max_blocks = call.block_table ? call.block_table->cols : 0;
    base.block_size = ks[1];
    base.block_count = ks[0];
  }
  const auto with_host = [qlens, klens, table](core::LightningIndexerParams p) {
    p.seq_q_lens = qlens->empty() ? nullptr : qlens->data();
    p.seq_k_lens = klens->empty() ? nullptr : klens->data();
    p.block_table = table->empty() ? nullptr : table->data();
    return p;
  };
  // No heads at all (N1 = N2 = 0): nothing to compute; the rest is checked as with heads.
  const bool no_heads = base.heads_q == 0 && base.heads_k == 0;
  {
    core::LightningIndexerParams p = with_host(base);
    if (no_heads) p.heads_q = p.heads_k = 1;
    checked([&] {
      core::validate(p);
      return 0;
    });
  }
  std::vector<int64_t> shape = {base.heads_k, base.sparse_count};
  shape.insert(shape.begin(), qs.begin(), qs.begin() + (tnd ? 1 : 2));
  const std::vector<OutputSpec> outs{
      {mindspore::kNumberTypeInt32, shape},
      {mindspore::kNumberTypeFloat32, call.return_value ? shape : std::vector<int64_t>{0}}};
  const bool values = call.return_value;
  return launch("OpmeshLightningIndexer", {call.query, call.key, call.weights}, outs,
                [base, with_host, tnd, paged, no_heads, values](const std::vector<ms::Tensor>& in,
                                                                std::vector<ms::Tensor>& out) {
                  core::LightningIndexerParams p = with_host(base);
                  p.indices = out[0].data_ptr<int32_t>();
                  p.values = values ? out[1].data_ptr<float>() : nullptr;
                  if (no_heads) return;
                  p.query = in[0].GetDataPtr();
                  p.key = in[1].GetDataPtr();
                  p.weights = in[2].GetDataPtr();
                  const auto fill = [](const ms::Tensor& t, int off, int64_t* dst, int n) {
                    const std::vector<int64_t> s = strides_of(t);
                    for (int i = 0; i < n; ++i) {
                      const int dim = i + off;
                      dst[i] = dim >= 0 && dim < static_cast<int>(s.size()) ? s[dim] : 0;
                    }
                  };
                  fill(in[0], tnd ? -1 : 0, p.query_stride, 4);
                  fill(in[1], paged ? 0 : (tnd ? -1 : 0), p.key_stride, 4);
                  fill(in[2], tnd ? -1 : 0, p.weights_stride, 3);
                  checked([&] {
                    core::lightning_indexer(p, ThreadExecutor(), core::active_isa());
                    return 0;
                  });
                });
}

}  // namespace opmesh::ms_binding
