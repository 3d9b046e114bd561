// The indexer's softmax statistics, its dense and sparse KL losses and the paged-cache write on
// MindSpore tensors.
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "cache_params.h"
#include "conventions.h"
#include "cpu_features.h"
#include "indexer/indexer.h"
#include "indexer/indexer_kl_loss.h"
#include "indexer/sparse_kl_loss.h"
#include "kv_cache.h"
#include "ms_call.h"
#include "sequence_params.h"

namespace opmesh::ms_binding {
namespace {

// The core's checks of the indexer's parameters; with no heads at all, as with one head each.
void validate_with_heads(core::IndexerParams p) {
  if (p.heads_q == 0 && p.heads_k == 0) p.heads_q = p.heads_k = 1;
  checked([&] {
    core::validate(p);
    return 0;
  });
}

// The indexer family's layout, read by the shared convention parser.
template <class Call>
bool is_tnd(const Call& call) {
  return checked([&] { return conventions::indexer_layout(call.layout); }) == core::Layout::kTND;
}

}  // namespace

py::object indexer(const IndexerCall& call) {
  const bool tnd = is_tnd(call);
  resolve({&call.query_index, &call.key_index, &call.weights});
  const size_t rank = tnd ? 3 : 4;
  require_rank(call.query_index, rank, "query_index");
  require_rank(call.key_index, rank, "key_index");
  require_rank(call.weights, rank - 1, "weights");
  auto host = std::make_shared<common::HostArrays>(common::indexer_host(call));
  const core::IndexerParams base = checked([&] { return common::indexer_params(call, *host); });
  // No heads at all (N1 = N2 = 0): nothing to compute; the rest is checked as with heads.
  const bool no_heads = base.heads_q == 0 && base.heads_k == 0;
  validate_with_heads(base);
  const std::vector<int64_t> shape =
      tnd ? std::vector<int64_t>{base.heads_k, base.seq_q}
          : std::vector<int64_t>{base.batch, base.heads_k, base.seq_q};
  const std::vector<OutputSpec> outs{{mindspore::kNumberTypeFloat32, shape},
                                     {mindspore::kNumberTypeFloat32, shape}};
  return launch("OpmeshIndexer", inputs_of(call), outs,
                [call, base, host, no_heads](const std::vector<ms::Tensor>& in,
                                             std::vector<ms::Tensor>& out) {
                  if (no_heads) return;
                  core::IndexerParams p = base;
                  common::point_indexer(p, with_inputs(call, in));
                  p.softmax_max = out[0].data_ptr<float>();
                  p.softmax_sum = out[1].data_ptr<float>();
                  checked([&] {
                    cpu_kernels().dense_lightning_indexer_softmax_lse(p, ThreadExecutor());
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
  auto host = std::make_shared<common::HostArrays>(common::indexer_host(call));
  // The length arrays' checks are the indexer's (the same mask over the same tokens).
  validate_with_heads(checked([&] { return common::indexer_params(call, *host); }));
  const core::IndexerKlLossParams base =
      checked([&] { return common::kl_loss_params(call, *host); });
  // No heads on either side: nothing to compare, the loss is 0 and the gradients zero.
  const bool no_heads = (base.heads_q == 0 && base.heads_k == 0) ||
                        (base.index_heads_q == 0 && base.index_heads_k == 0);
  auto spec = [](const ms::Tensor& t) {
    return OutputSpec{t.data_type(), std::vector<int64_t>(t.shape().begin(), t.shape().end())};
  };
  const std::vector<OutputSpec> outs{spec(call.query_index),
                                     spec(call.key_index),
                                     spec(call.weights),
                                     {mindspore::kNumberTypeFloat32, {1}}};
  return launch(kernel, inputs_of(call), outs,
                [call, base, host, no_heads](const std::vector<ms::Tensor>& in,
                                             std::vector<ms::Tensor>& out) {
                  // Rows no sequence covers keep a zero gradient.
                  for (ms::Tensor& t : out) {
                    std::memset(t.GetDataPtr(), 0, t.numel() * element_bytes(t));
                  }
                  if (no_heads) return;
                  const Call c = with_inputs(call, in);
                  core::IndexerKlLossParams p = base;
                  const ms::Tensor outputs[4] = {out[0], out[1], out[2], out[3]};
                  common::point_kl_loss(p, c, outputs);
                  checked([&] {
                    if constexpr (kSparseKl<Call>) {
                      cpu_kernels().sparse_lightning_indexer_grad_kl_loss(
                          common::sparse_kl_loss_params(p, c), ThreadExecutor());
                    } else {
                      cpu_kernels().dense_lightning_indexer_grad_kl_loss(p, ThreadExecutor());
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
  // (One cache of rows read as key and value, without value and value_cache: PyTorch only.)
  if (!call.value.has_value() || !call.value_cache.has_value()) {
    value_error("value: and value_cache are required on MindSpore tensors");
  }
  const ms::Tensor& value = *call.value;
  const ms::Tensor& value_cache = *call.value_cache;
  resolve({&call.key, &value, &call.key_cache, &value_cache});
  resolve(call.key_scale);
  resolve(call.value_scale);
  require_rank(call.key, 3, "key");
  require_rank(value, 3, "value");
  require_rank(call.key_cache, 4, "key_cache");
  require_rank(value_cache, 4, "value_cache");
  if (static_cast<int64_t>(slot_mapping.size()) != call.key.shape()[0]) {
    value_error("slot_mapping: expected one entry per token of key");
  }
  // (A quantized cache, int8 with its scales, takes keys and values of any floating dtype.)
  const bool quantized = cache_format(call.key_cache) != core::CacheFormat::kPlain;
  for (const auto& [t, like, name] :
       {std::tuple{&value, &call.key, "value"},
        std::tuple{&call.key_cache, quantized ? &call.key_cache : &call.key, "key_cache"},
        std::tuple{&value_cache, &call.key_cache, "value_cache"}}) {
    if (t->data_type() != like->data_type()) value_error(std::string(name) + ": dtype differs");
  }
  if (quantized != (call.key_scale.has_value() && call.value_scale.has_value())) {
    value_error("key_scale: a quantized cache takes key_scale and value_scale, another none");
  }
  if (call.key_cache.shape()[2] != call.key.shape()[1] ||
      call.key_cache.shape()[3] != call.key.shape()[2] ||
      value_cache.shape()[2] != value.shape()[1] || value_cache.shape()[3] != value.shape()[2] ||
      value.shape()[0] != call.key.shape()[0] ||
      value_cache.shape()[0] != call.key_cache.shape()[0] ||
      value_cache.shape()[1] != call.key_cache.shape()[1]) {
    value_error("value_cache: shapes of key, value and the caches do not agree");
  }
  auto slots = std::make_shared<std::vector<int64_t>>(slot_mapping);
  const core::KvCacheWriteParams base = common::kv_cache_params(call, *slots);
  checked([&] {
    core::check_slots(base);
    return 0;
  });
  // The caches are written in place: they are the runner's inputs (contiguous, so MindSpore hands
  // over their own memory), and the runner has no output.
  return launch("OpmeshKvCacheWrite", inputs_of(call), {},
                [call, base, slots](const std::vector<ms::Tensor>& in, std::vector<ms::Tensor>&) {
                  core::KvCacheWriteParams p = base;
                  common::point_kv_cache(p, with_inputs(call, in));
                  checked([&] {
                    cpu_kernels().kv_cache_write(p, ThreadExecutor());
                    return 0;
                  });
                });
}

}  // namespace opmesh::ms_binding
