// The indexer's softmax statistics, its dense and sparse KL losses and the paged-cache write on
// MindSpore tensors.
#include <cmath>
#include <cstring>
#include <type_traits>

#include "conventions.h"
#include "cpu_features.h"
#include "indexer/indexer.h"
#include "indexer/indexer_kl_loss.h"
#include "indexer/sparse_kl_loss.h"
#include "kv_cache.h"
#include "ms_call.h"

namespace opmesh::ms_binding {
namespace {

const std::vector<int64_t>& lengths_or_empty(const std::optional<HostInts>& l) {
  static const std::vector<int64_t> empty;
  return l.has_value() ? l->values : empty;
}

// The core's checks of the indexer's parameters; with no heads at all, as with one head each.
void validate_with_heads(core::IndexerParams p) {
  if (p.heads_q == 0 && p.heads_k == 0) p.heads_q = p.heads_k = 1;
  checked([&] {
    core::validate(p);
    return 0;
  });
}

// Strides of a runner tensor in the core's {b, s, n, d} order (TND: {0, t, n, d}).
void core_strides(const ms::Tensor& t, bool tnd, int64_t* out, int count) {
  const std::vector<int64_t> s = strides_of(t);
  const int off = tnd ? -1 : 0;
  for (int i = 0; i < count; ++i) {
    const int dim = i + off;
    out[i] = dim >= 0 && dim < static_cast<int>(s.size()) ? s[dim] : 0;
  }
}

// The indexer family's layout, read by the shared convention parser.
template <class Call>
bool is_tnd(const Call& call) {
  return checked([&] { return conventions::indexer_layout(call.layout); }) == core::Layout::kTND;
}

// The core's indexer parameters of a call (the indexer's, or the KL loss's index tensors), with
// `qlens`/`klens` the host lengths the core reads.
template <class Call>
core::IndexerParams indexer_params(const Call& call, const std::vector<int64_t>& qlens,
                                   const std::vector<int64_t>& klens) {
  const ms::Tensor& q = call.query_index;
  const ms::Tensor& k = call.key_index;
  const ms::Tensor& w = call.weights;
  const bool tnd = is_tnd(call);
  const int off = tnd ? -1 : 0;
  core::IndexerParams p;
  p.layout = tnd ? core::Layout::kTND : core::Layout::kBSND;
  p.sparse_mode = checked([&] { return conventions::sparse_mode(call.sparse_mode); });
  p.pre_tokens = call.pre_tokens;
  p.next_tokens = call.next_tokens;
  p.batch = tnd ? static_cast<int64_t>(qlens.size()) : q.shape()[0];
  p.seq_q = q.shape()[1 + off];
  p.seq_k = k.shape()[1 + off];
  p.heads_q = q.shape()[2 + off];
  p.heads_k = k.shape()[2 + off];
  p.head_dim = q.shape()[3 + off];
  p.qk_dtype = core_dtype(q, "query_index");
  p.weights_dtype = core_dtype(w, "weights");
  p.seq_q_lens = qlens.empty() ? nullptr : qlens.data();
  p.seq_k_lens = klens.empty() ? nullptr : klens.data();
  return p;
}

}  // namespace

py::object indexer(const IndexerCall& call) {
  const bool tnd = is_tnd(call);
  resolve({&call.query_index, &call.key_index, &call.weights});
  const size_t rank = tnd ? 3 : 4;
  require_rank(call.query_index, rank, "query_index");
  require_rank(call.key_index, rank, "key_index");
  require_rank(call.weights, rank - 1, "weights");
  auto qlens = std::make_shared<std::vector<int64_t>>(lengths_or_empty(call.actual_seq_qlen));
  auto klens = std::make_shared<std::vector<int64_t>>(lengths_or_empty(call.actual_seq_klen));
  const core::IndexerParams base = indexer_params(call, *qlens, *klens);
  // No heads at all (N1 = N2 = 0): nothing to compute; the rest is checked as with heads.
  const bool no_heads = base.heads_q == 0 && base.heads_k == 0;
  validate_with_heads(base);
  const std::vector<int64_t> shape =
      tnd ? std::vector<int64_t>{base.heads_k, base.seq_q}
          : std::vector<int64_t>{base.batch, base.heads_k, base.seq_q};
  const std::vector<OutputSpec> outs{{mindspore::kNumberTypeFloat32, shape},
                                     {mindspore::kNumberTypeFloat32, shape}};
  return launch("OpmeshIndexer", {call.query_index, call.key_index, call.weights}, outs,
                [base, qlens, klens, tnd, no_heads](const std::vector<ms::Tensor>& in,
                                                    std::vector<ms::Tensor>& out) {
                  if (no_heads) return;
                  core::IndexerParams p = base;
                  p.seq_q_lens = qlens->empty() ? nullptr : qlens->data();
                  p.seq_k_lens = klens->empty() ? nullptr : klens->data();
                  p.query = in[0].GetDataPtr();
                  p.key = in[1].GetDataPtr();
                  p.weights = in[2].GetDataPtr();
                  core_strides(in[0], tnd, p.query_stride, 4);
                  core_strides(in[1], tnd, p.key_stride, 4);
                  core_strides(in[2], tnd, p.weights_stride, 3);
                  p.softmax_max = out[0].data_ptr<float>();
                  p.softmax_sum = out[1].data_ptr<float>();
                  checked([&] {
                    core::dense_lightning_indexer_softmax_lse(p, ThreadExecutor(),
                                                              core::active_isa());
                    return 0;
                  });
                });
}

namespace {

template <class Call>
constexpr bool kSparseKl = std::is_same_v<Call, SparseKlLossCall>;

// Resolves the call's tensors and checks their ranks (the shapes are the torch binding's
// shape function's, run by the Python layer on meta stand-ins).
template <class Call>
void check_kl_ranks(const Call& call, bool tnd) {
  resolve({&call.query, &call.key, &call.query_index, &call.key_index, &call.weights,
           &call.softmax_max, &call.softmax_sum});
  if constexpr (kSparseKl<Call>) {
    resolve({&call.sparse_indices});
  } else {
    resolve({&call.softmax_max_index, &call.softmax_sum_index});
  }
  resolve(call.query_rope);
  resolve(call.key_rope);
  const size_t rank = tnd ? 3 : 4;
  for (const auto& [t, name] : {std::pair{&call.query, "query"},
                                {&call.key, "key"},
                                {&call.query_index, "query_index"},
                                {&call.key_index, "key_index"}}) {
    require_rank(*t, rank, name);
  }
  require_rank(call.weights, rank - 1, "weights");
  if constexpr (kSparseKl<Call>) {
    require_rank(call.sparse_indices, rank, "sparse_indices");
  }
  if (call.query_rope.has_value() != call.key_rope.has_value()) {
    value_error("query_rope: query_rope and key_rope are given together or not at all");
  }
  if (call.query_rope.has_value()) {
    require_rank(*call.query_rope, rank, "query_rope");
    require_rank(*call.key_rope, rank, "key_rope");
  }
}

// The dense and the sparse KL loss: the same tensors but the dense loss's index statistics or
// the sparse loss's selection (int32, converted by the Python layer).
template <class Call>
py::object kl_loss(const Call& call, const char* kernel) {
  const bool tnd = is_tnd(call);
  check_kl_ranks(call, tnd);
  const size_t rank = tnd ? 3 : 4;
  int64_t index_heads = 1, sparse_count = 0;
  if constexpr (kSparseKl<Call>) {
    index_heads = call.sparse_indices.shape()[rank - 2];
    sparse_count = call.sparse_indices.shape()[rank - 1];
  }
  auto qlens = std::make_shared<std::vector<int64_t>>(lengths_or_empty(call.actual_seq_qlen));
  auto klens = std::make_shared<std::vector<int64_t>>(lengths_or_empty(call.actual_seq_klen));
  // The length arrays' checks are the indexer's (the same mask over the same tokens).
  const core::IndexerParams index = indexer_params(call, *qlens, *klens);
  validate_with_heads(index);
  const int off = tnd ? -1 : 0;
  core::IndexerKlLossParams base;
  base.layout = tnd ? core::Layout::kTND : core::Layout::kBSND;
  base.sparse_mode = index.sparse_mode;
  base.pre_tokens = call.pre_tokens;
  base.next_tokens = call.next_tokens;
  base.batch = tnd ? static_cast<int64_t>(qlens->size()) : call.query_index.shape()[0];
  base.seq_q = call.query_index.shape()[1 + off];
  base.seq_k = call.key_index.shape()[1 + off];
  base.heads_q = call.query.shape()[2 + off];
  base.heads_k = call.key.shape()[2 + off];
  base.head_dim = call.query.shape()[3 + off];
  base.rope_dim = call.query_rope.has_value() ? call.query_rope->shape()[3 + off] : 0;
  base.index_heads_q = call.query_index.shape()[2 + off];
  base.index_heads_k = call.key_index.shape()[2 + off];
  base.index_dim = call.query_index.shape()[3 + off];
  base.scale = static_cast<float>(call.scale_value);
  // No heads on either side: nothing to compare, the loss is 0 and the gradients zero.
  const bool no_heads = (base.heads_q == 0 && base.heads_k == 0) ||
                        (base.index_heads_q == 0 && base.index_heads_k == 0);
  const bool rope = call.query_rope.has_value();
  std::vector<ms::Tensor> inputs{call.query,   call.key,         call.query_index, call.key_index,
                                 call.weights, call.softmax_max, call.softmax_sum};
  if constexpr (kSparseKl<Call>) {
    inputs.push_back(call.sparse_indices);
  } else {
    inputs.push_back(call.softmax_max_index);
    inputs.push_back(call.softmax_sum_index);
  }
  const size_t rope_at = inputs.size();
  if (rope) {
    inputs.push_back(*call.query_rope);
    inputs.push_back(*call.key_rope);
  }
  auto spec = [](const ms::Tensor& t) {
    return OutputSpec{t.data_type(), std::vector<int64_t>(t.shape().begin(), t.shape().end())};
  };
  const std::vector<OutputSpec> outs{spec(call.query_index),
                                     spec(call.key_index),
                                     spec(call.weights),
                                     {mindspore::kNumberTypeFloat32, {1}}};
  return launch(
      kernel, inputs, outs,
      [base, qlens, klens, tnd, rope, rope_at, no_heads, index_heads, sparse_count](
          const std::vector<ms::Tensor>& in, std::vector<ms::Tensor>& out) {
        core::IndexerKlLossParams p = base;
        p.seq_q_lens = qlens->empty() ? nullptr : qlens->data();
        p.seq_k_lens = klens->empty() ? nullptr : klens->data();
        auto operand = [&](const ms::Tensor& t, const char* name) {
          core::KlOperand o;
          o.data = t.GetDataPtr();
          o.dtype = core_dtype(t, name);
          core_strides(t, tnd, o.stride, 4);
          return o;
        };
        // Rows no sequence covers keep a zero gradient.
        auto gradient = [&](ms::Tensor& t) {
          std::memset(t.GetDataPtr(), 0, t.numel() * element_bytes(t));
          const core::KlOperand o = operand(t, "gradient");
          core::KlGradient g;
          g.data = t.GetDataPtr();
          g.dtype = o.dtype;
          std::copy(o.stride, o.stride + 4, g.stride);
          return g;
        };
        p.query = operand(in[0], "query");
        p.key = operand(in[1], "key");
        p.query_index = operand(in[2], "query_index");
        p.key_index = operand(in[3], "key_index");
        p.weights = operand(in[4], "weights");
        p.softmax_max = in[5].data_ptr<float>();
        p.softmax_sum = in[6].data_ptr<float>();
        if (rope) {
          p.query_rope = operand(in[rope_at], "query_rope");
          p.key_rope = operand(in[rope_at + 1], "key_rope");
        }
        p.d_query_index = gradient(out[0]);
        p.d_key_index = gradient(out[1]);
        p.d_weights = gradient(out[2]);
        p.loss = out[3].data_ptr<float>();
        *p.loss = 0.0f;
        if (no_heads) return;
        checked([&] {
          if constexpr (kSparseKl<Call>) {
            core::SparseKlLossParams sp;
            sp.dense = p;
            sp.indices = static_cast<const int32_t*>(in[7].GetDataPtr());
            core_strides(in[7], tnd, sp.indices_stride, 4);
            sp.index_heads = index_heads;
            sp.sparse_count = sparse_count;
            core::sparse_lightning_indexer_grad_kl_loss(sp, ThreadExecutor(), core::active_isa());
          } else {
            p.softmax_max_index = in[7].data_ptr<float>();
            p.softmax_sum_index = in[8].data_ptr<float>();
            core::dense_lightning_indexer_grad_kl_loss(p, ThreadExecutor(), core::active_isa());
          }
          return 0;
        });
      });
}

}  // namespace

py::object indexer_grad_kl_loss(const KlLossCall& call) {
  return kl_loss(call, "OpmeshIndexerKlLoss");
}

py::object sparse_indexer_grad_kl_loss(const SparseKlLossCall& call) {
  return kl_loss(call, "OpmeshSparseIndexerKlLoss");
}

py::object kv_cache_write(const KvCacheWriteCall& call) {
  const std::vector<int64_t>& slot_mapping = call.slot_mapping.values;
  resolve({&call.key, &call.value, &call.key_cache, &call.value_cache});
  require_rank(call.key, 3, "key");
  require_rank(call.value, 3, "value");
  require_rank(call.key_cache, 4, "key_cache");
  require_rank(call.value_cache, 4, "value_cache");
  if (static_cast<int64_t>(slot_mapping.size()) != call.key.shape()[0]) {
    value_error("slot_mapping: expected one entry per token of key");
  }
  for (const auto& [t, name] : {std::pair{&call.value, "value"},
                                {&call.key_cache, "key_cache"},
                                {&call.value_cache, "value_cache"}}) {
    if (t->data_type() != call.key.data_type()) value_error(std::string(name) + ": dtype differs");
  }
  if (call.key_cache.shape()[2] != call.key.shape()[1] ||
      call.key_cache.shape()[3] != call.key.shape()[2] ||
      call.value_cache.shape()[2] != call.value.shape()[1] ||
      call.value_cache.shape()[3] != call.value.shape()[2] ||
      call.value.shape()[0] != call.key.shape()[0] ||
      call.value_cache.shape()[0] != call.key_cache.shape()[0] ||
      call.value_cache.shape()[1] != call.key_cache.shape()[1]) {
    value_error("value_cache: shapes of key, value and the caches do not agree");
  }
  core::KvCacheWriteParams base;
  base.tokens = call.key.shape()[0];
  base.heads = call.key.shape()[1];
  base.dim_k = call.key.shape()[2];
  base.dim_v = call.value.shape()[2];
  base.elem_bytes = element_bytes(call.key);
  base.num_blocks = call.key_cache.shape()[0];
  base.block_size = call.key_cache.shape()[1];
  auto slots = std::make_shared<std::vector<int64_t>>(slot_mapping);
  base.slots = slots->data();
  checked([&] {
    core::check_slots(base);
    return 0;
  });
  // The caches are written in place: they are the runner's inputs (contiguous, so MindSpore hands
  // over their own memory), and the runner has no output.
  return launch("OpmeshKvCacheWrite", {call.key, call.value, call.key_cache, call.value_cache}, {},
                [base, slots](const std::vector<ms::Tensor>& in, std::vector<ms::Tensor>&) {
                  core::KvCacheWriteParams p = base;
                  p.slots = slots->data();
                  p.key = in[0].GetDataPtr();
                  p.value = in[1].GetDataPtr();
                  p.key_cache = in[2].GetDataPtr();
                  p.value_cache = in[3].GetDataPtr();
                  const auto ks = strides_of(in[0]), vs = strides_of(in[1]);
                  const auto kcs = strides_of(in[2]), vcs = strides_of(in[3]);
                  for (int i = 0; i < 3; ++i) {
                    p.key_stride[i] = ks[i];
                    p.value_stride[i] = vs[i];
                  }
                  for (int i = 0; i < 4; ++i) {
                    p.key_cache_stride[i] = kcs[i];
                    p.value_cache_stride[i] = vcs[i];
                  }
                  checked([&] {
                    core::kv_cache_write(p, ThreadExecutor());
                    return 0;
                  });
                });
}

}  // namespace opmesh::ms_binding
