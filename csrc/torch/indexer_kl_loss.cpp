// CPU kernels and shape functions of dense_lightning_indexer_grad_kl_loss and
// sparse_lightning_indexer_grad_kl_loss. The index tensors, lengths, layout and mask are checked
// as dense_lightning_indexer_softmax_lse checks them; the main attention's tensors, the
// statistics and sparse_indices here.
#include "indexer/indexer_kl_loss.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "aten_executor.h"
#include "dtypes.h"
#include "errors.h"
#include "indexer/sparse_kl_loss.h"
#include "indexer_checks.h"
#include "output_memory.h"
#include "sequence_params.h"
#include "torch_access.h"

namespace opmesh::binding {
namespace {

using SymSizes = std::vector<c10::SymInt>;

void expect_shape(const at::Tensor& t, const char* name, const SymSizes& expected,
                  const char* what) {
  bool same = t.dim() == static_cast<int64_t>(expected.size());
  for (int64_t i = 0; same && i < t.dim(); ++i) same = holds(t.sym_size(i) == expected[i]);
  TORCH_CHECK_VALUE(same, name, ": expected shape ", c10::SymIntArrayRef(expected), " (", what,
                    "), got ", t.sym_sizes());
}

struct KlShapes {
  bool tnd;
  int64_t n1, n2, d, dr, n1i, n2i, di;
  bool no_heads = false;  // the main attention's or the indexer's heads are none
  int64_t index_heads = 1, sparse_count = 0;  // sparse_indices' key-head dim and K
};

template <class Call>
constexpr bool kSparse = std::is_same_v<Call, SparseKlLossCall>;

// The tensors only one of the two losses takes: the dense loss's index statistics, the sparse
// loss's selection (nullptr where absent).
template <class Call>
std::array<const at::Tensor*, 3> own_tensors(const Call& a) {
  if constexpr (kSparse<Call>) {
    return {nullptr, nullptr, &a.sparse_indices};
  } else {
    return {&a.softmax_max_index, &a.softmax_sum_index, nullptr};
  }
}

// Every tensor of the call on query_index's device.
template <class Call>
void check_kl_devices(const Call& a) {
  const at::Device device = a.query_index.device();
  const auto [index_max, index_sum, indices] = own_tensors(a);
  const std::pair<const at::Tensor*, const char*> tensors[] = {
      {&a.query, "query"},
      {&a.key, "key"},
      {&a.softmax_max, "softmax_max"},
      {&a.softmax_sum, "softmax_sum"},
      {index_max, "softmax_max_index"},
      {index_sum, "softmax_sum_index"},
      {indices, "sparse_indices"},
      {a.query_rope ? &*a.query_rope : nullptr, "query_rope"},
      {a.key_rope ? &*a.key_rope : nullptr, "key_rope"},
  };
  for (const auto& [t, name] : tensors) {
    if (t == nullptr) continue;
    TORCH_CHECK_VALUE(t->device() == device, name, ": expected a tensor on ", device,
                      " like query_index, got ", t->device());
  }
}

template <class Call>
KlShapes check_kl_args(const Call& a) {
  check_indexer_args(a);
  const bool tnd = indexer_layout(a.layout) == core::Layout::kTND;
  check_kl_devices(a);
  const auto [index_max, index_sum, indices] = own_tensors(a);
  to_core_dtype(a.query.scalar_type(), "query");
  TORCH_CHECK_TYPE(a.key.scalar_type() == a.query.scalar_type(), "key: expected dtype ",
                   a.query.scalar_type(), " like query, got ", a.key.scalar_type());
  const int64_t rank = tnd ? 3 : 4;
  TORCH_CHECK_VALUE(a.query.dim() == rank, "query: expected a ", rank, "-D ", a.layout,
                    " tensor, got shape ", a.query.sizes());
  TORCH_CHECK_VALUE(a.key.dim() == rank, "key: expected a ", rank, "-D ", a.layout,
                    " tensor, got shape ", a.key.sizes());
  const int off = tnd ? -1 : 0;
  KlShapes s{tnd, 0, 0, 0, 0, 0, 0, 0, false};
  s.n1 = concrete(a.query.sym_size(2 + off));
  s.n2 = concrete(a.key.sym_size(2 + off));
  s.d = concrete(a.query.sym_size(3 + off));
  s.n1i = concrete(a.query_index.sym_size(2 + off));
  s.n2i = concrete(a.key_index.sym_size(2 + off));
  s.di = concrete(a.query_index.sym_size(3 + off));
  // No heads on either side (N1 = N2 = 0) leaves nothing to compare: the loss is 0.
  s.no_heads = (s.n1 == 0 && s.n2 == 0) || (s.n1i == 0 && s.n2i == 0);
  const bool main_none = s.n1 == 0 && s.n2 == 0;
  TORCH_CHECK_VALUE(main_none || (s.n1 >= 1 && s.n1 <= core::kMaxHeads),
                    "query: N1 must be in [1, ", core::kMaxHeads, "], got shape ",
                    a.query.sym_sizes());
  TORCH_CHECK_VALUE(main_none || (s.n2 >= 1 && s.n2 <= core::kMaxHeads), "key: N2 must be in [1, ",
                    core::kMaxHeads, "], got shape ", a.key.sym_sizes());
  TORCH_CHECK_VALUE(main_none || s.n1 % s.n2 == 0, "key: query heads N1=", s.n1,
                    " must be a multiple of key heads N2=", s.n2);
  TORCH_CHECK_VALUE(s.d >= 1 && s.d <= core::kMaxHeadDim, "query: head dim D must be in [1, ",
                    core::kMaxHeadDim, "], got shape ", a.query.sym_sizes());
  SymSizes qlead(a.query_index.sym_sizes().begin(), a.query_index.sym_sizes().end() - 2);
  SymSizes klead(a.key_index.sym_sizes().begin(), a.key_index.sym_sizes().end() - 2);
  auto with = [](SymSizes lead, std::initializer_list<c10::SymInt> tail) {
    lead.insert(lead.end(), tail.begin(), tail.end());
    return lead;
  };
  expect_shape(a.query, "query", with(qlead, {c10::SymInt(s.n1), c10::SymInt(s.d)}),
               "query_index's tokens, N1 heads, D");
  expect_shape(a.key, "key", with(klead, {c10::SymInt(s.n2), c10::SymInt(s.d)}),
               "key_index's tokens, N2 heads, query's D");
  TORCH_CHECK_VALUE(a.query_rope.has_value() == a.key_rope.has_value(),
                    a.query_rope ? "key_rope" : "query_rope",
                    ": query_rope and key_rope are given together or not at all");
  if (a.query_rope.has_value()) {
    TORCH_CHECK_TYPE(a.query_rope->scalar_type() == a.query.scalar_type(),
                     "query_rope: expected dtype ", a.query.scalar_type(), " like query, got ",
                     a.query_rope->scalar_type());
    TORCH_CHECK_TYPE(a.key_rope->scalar_type() == a.query.scalar_type(),
                     "key_rope: expected dtype ", a.query.scalar_type(), " like query, got ",
                     a.key_rope->scalar_type());
    TORCH_CHECK_VALUE(a.query_rope->dim() == rank, "query_rope: expected a ", rank,
                      "-D tensor, got shape ", a.query_rope->sizes());
    s.dr = concrete(a.query_rope->sym_size(3 + off));
    TORCH_CHECK_VALUE(s.dr >= 1 && s.d + s.dr <= core::kMaxHeadDim,
                      "query_rope: rope dim Dr must be >= 1 with D + Dr <= ", core::kMaxHeadDim,
                      ", got shape ", a.query_rope->sym_sizes());
    expect_shape(*a.query_rope, "query_rope", with(qlead, {c10::SymInt(s.n1), c10::SymInt(s.dr)}),
                 "query's tokens and heads");
    expect_shape(*a.key_rope, "key_rope", with(klead, {c10::SymInt(s.n2), c10::SymInt(s.dr)}),
                 "key's tokens and heads, query_rope's Dr");
  }
  const c10::SymInt g(main_none ? 0 : s.n1 / s.n2);
  const SymSizes stats =
      tnd ? SymSizes{c10::SymInt(s.n2), a.query_index.sym_size(0), g}
          : SymSizes{a.query_index.sym_size(0), c10::SymInt(s.n2), a.query_index.sym_size(1), g};
  const SymSizes index_stats =
      tnd ? SymSizes{c10::SymInt(s.n2i), a.query_index.sym_size(0)}
          : SymSizes{a.query_index.sym_size(0), c10::SymInt(s.n2i), a.query_index.sym_size(1)};
  const char* stats_what = tnd ? "[N2, T1, N1 / N2]" : "[B, N2, S1, N1 / N2]";
  const char* index_what = tnd ? "[N2index, T1]" : "[B, N2index, S1]";
  const std::tuple<const at::Tensor*, const char*, const SymSizes*, const char*> all_stats[] = {
      {&a.softmax_max, "softmax_max", &stats, stats_what},
      {&a.softmax_sum, "softmax_sum", &stats, stats_what},
      {index_max, "softmax_max_index", &index_stats, index_what},
      {index_sum, "softmax_sum_index", &index_stats, index_what},
  };
  for (const auto& [t, name, shape, what] : all_stats) {
    if (t == nullptr) continue;
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, name, ": expected float32, got ",
                     t->scalar_type());
    expect_shape(*t, name, *shape, what);
  }
  if (indices != nullptr) {
    const at::Tensor& idx = *indices;
    TORCH_CHECK_TYPE(idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong,
                     "sparse_indices: expected int32 or int64, got ", idx.scalar_type());
    TORCH_CHECK_VALUE(idx.dim() == rank, "sparse_indices: expected a ", rank,
                      "-D tensor (query_index's tokens, key heads, K), got shape ", idx.sizes());
    for (int64_t i = 0; i + 2 < rank; ++i) {
      TORCH_CHECK_VALUE(holds(idx.sym_size(i) == a.query_index.sym_size(i)),
                        "sparse_indices: expected leading dims ", c10::SymIntArrayRef(qlead),
                        " like query_index, got shape ", idx.sym_sizes());
    }
    s.index_heads = concrete(idx.sym_size(-2));
    s.sparse_count = concrete(idx.sym_size(-1));
    TORCH_CHECK_VALUE(s.no_heads || s.index_heads == 1 || s.index_heads == s.n2i,
                      "sparse_indices: key-head dim must be 1 or N2index=", s.n2i, ", got shape ",
                      idx.sym_sizes());
  }
  TORCH_CHECK_VALUE(std::isfinite(a.scale_value), "scale_value: must be finite, got ",
                    a.scale_value);
  return s;
}

// sparse_indices as int32 for the core; int64 entries outside int32's range are refused here
// (narrowing them could turn a bad entry into a valid one).
at::Tensor int32_indices(const at::Tensor& idx) {
  if (idx.scalar_type() == at::kInt) return idx;
  if (idx.numel() > 0) {
    const int64_t lo = idx.min().item<int64_t>(), hi = idx.max().item<int64_t>();
    TORCH_CHECK_VALUE(lo >= -1 && hi <= std::numeric_limits<int32_t>::max(),
                      "sparse_indices: entries must be -1 or key positions, got values in [", lo,
                      ", ", hi, "]");
  }
  return idx.to(at::kInt);
}

template <class Call>
Outputs4 kl_loss_cpu(const Call& call) {
  TORCH_CHECK_VALUE(call.query_index.device().is_cpu(), "query_index: expected a CPU tensor, got ",
                    call.query_index.device());
  const KlShapes s = check_kl_args(call);
  const common::HostArrays host = common::indexer_host(call);
  // The statistics float32 contiguous and the selection int32, as the core reads them.
  Call a = call;
  a.softmax_max = a.softmax_max.contiguous();
  a.softmax_sum = a.softmax_sum.contiguous();
  if constexpr (kSparse<Call>) {
    a.sparse_indices = int32_indices(a.sparse_indices);
  } else {
    a.softmax_max_index = a.softmax_max_index.contiguous();
    a.softmax_sum_index = a.softmax_sum_index.contiguous();
  }
  // Rows no sequence covers keep a zero gradient.
  const at::Tensor out[4] = {empty_output(a.query_index.sizes(), a.query_index.options()).zero_(),
                             empty_output(a.key_index.sizes(), a.key_index.options()).zero_(),
                             at::zeros_like(a.weights, at::MemoryFormat::Contiguous),
                             at::zeros({1}, a.query_index.options().dtype(at::kFloat))};
  core::IndexerKlLossParams p = rethrow([&] { return common::kl_loss_params(a, host); });
  common::point_kl_loss(p, a, out);
  rethrow(
      [&] {
        if (s.no_heads) {
          // Nothing to compare: loss 0, zero gradients; the rest is checked as with heads.
          p.index_heads_q = p.index_heads_k = 1;
          core::validate(core::index_params(p));
          return;
        }
        if constexpr (kSparse<Call>) {
          const core::SparseKlLossParams sp = common::sparse_kl_loss_params(p, a);
          cpu_kernels().sparse_lightning_indexer_grad_kl_loss(sp, AtenExecutor());
        } else {
          cpu_kernels().dense_lightning_indexer_grad_kl_loss(p, AtenExecutor());
        }
      },
      [&] {
        return c10::str("query: the scratch memory for N1=", s.n1, ", D + Dr=", s.d + s.dr,
                        ", N1index=", s.n1i, " could not be allocated");
      });
  return {out[0], out[1], out[2], out[3]};
}

template <class Call>
Outputs4 kl_loss_meta(const Call& a) {
  check_kl_args(a);
  auto like = [](const at::Tensor& t) {
    return at::empty_symint(t.sym_sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  };
  return {like(a.query_index), like(a.key_index), like(a.weights),
          at::empty({1}, a.query_index.options().dtype(at::kFloat))};
}

}  // namespace

TORCH_LIBRARY_IMPL(opmesh, CPU, m) {
  impl<KlLossCall, kl_loss_cpu<KlLossCall>>(m);
  impl<SparseKlLossCall, kl_loss_cpu<SparseKlLossCall>>(m);
}

TORCH_LIBRARY_IMPL(opmesh, Meta, m) {
  impl<KlLossCall, kl_loss_meta<KlLossCall>>(m);
  impl<SparseKlLossCall, kl_loss_meta<SparseKlLossCall>>(m);
}

}  // namespace opmesh::binding
