// How the code shared by the bindings reads a binding's tensors and host arrays. Each binding
// specialises the two traits for its types (csrc/torch/torch_access.h, csrc/mindspore/ms_call.h):
//
//   template <> struct TensorAccess<Tensor> {
//     static const void* data(const Tensor&);               // the first element
//     static std::vector<int64_t> sizes(const Tensor&);
//     static std::vector<int64_t> strides(const Tensor&);   // in elements
//     static core::DType dtype(const Tensor&, const char* argument);  // floating types only
//     static int64_t element_size(const Tensor&);            // bytes per element
//     static core::CacheFormat cache_format(const Tensor&);  // int8, float8_e4m3fn, else plain
//   };
//   template <> struct HostIntsAccess<Ints> {                // the Ints kind of op_defs.h
//     static std::vector<int64_t> values(const Ints&);       // row by row
//     static int64_t columns(const Ints&);                   // 2-D: entries per row
//   };
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "dtype.h"
#include "selection.h"
#include "vocabulary.h"

namespace opmesh::common {

template <class Tensor>
struct TensorAccess;

template <class Ints>
struct HostIntsAccess;

template <class Tensor>
const void* data_of(const Tensor& t) {
  return TensorAccess<Tensor>::data(t);
}

template <class Tensor>
std::vector<int64_t> sizes_of(const Tensor& t) {
  return TensorAccess<Tensor>::sizes(t);
}

template <class Tensor>
int64_t element_size_of(const Tensor& t) {
  return TensorAccess<Tensor>::element_size(t);
}

template <class Tensor>
core::DType dtype_of(const Tensor& t, const char* argument) {
  return TensorAccess<Tensor>::dtype(t, argument);
}

// t as the kernels' View: its data and its strides along [batch][sequence][head][dim], where
// axis i is t's dim i + offset (a TND tensor's offset is -1: it has no batch dim; axes past t's
// dims get stride 0).
template <class Tensor>
core::View layout_view(const Tensor& t, int offset) {
  const std::vector<int64_t> st = TensorAccess<Tensor>::strides(t);
  auto stride = [&](int axis) {
    const int dim = axis + offset;
    return dim >= 0 && dim < static_cast<int>(st.size()) ? st[dim] : int64_t{0};
  };
  return core::View{data_of(t), stride(0), stride(1), stride(2), stride(3)};
}

template <class Tensor>
core::MutableView mutable_layout_view(const Tensor& t, int offset) {
  return core::writable(layout_view(t, offset));
}

// The host arrays a sequence operator's params point into (lengths, block table), kept alive
// with them; empty where the call has none.
struct HostArrays {
  std::vector<int64_t> q_lens, k_lens, table;
  int64_t table_columns = 0;
  // lightning_indexer's compressed keys: each sequence's residual original tokens, when given.
  std::vector<int64_t> residuals;
  bool residuals_given = false;

  const int64_t* q() const { return q_lens.empty() ? nullptr : q_lens.data(); }
  const int64_t* k() const { return k_lens.empty() ? nullptr : k_lens.data(); }
  const int64_t* blocks() const { return table.empty() ? nullptr : table.data(); }
};

template <class Ints>
std::vector<int64_t> host_values(const std::optional<Ints>& ints) {
  return ints.has_value() ? HostIntsAccess<Ints>::values(*ints) : std::vector<int64_t>{};
}

// A call's query lengths, key lengths and (optional) block table on the host.
template <class Ints>
HostArrays host_arrays(const std::optional<Ints>& q_lens, const std::optional<Ints>& k_lens,
                       const std::optional<Ints>& table = std::nullopt) {
  HostArrays h;
  h.q_lens = host_values(q_lens);
  h.k_lens = host_values(k_lens);
  h.table = host_values(table);
  h.table_columns = table.has_value() ? HostIntsAccess<Ints>::columns(*table) : 0;
  return h;
}

// A paged key tensor's [blocks, block_size, ...] sizes and its block table's host copy.
inline void fill_paged(core::PagedKeys& p, const std::vector<int64_t>& sizes, const int64_t* table,
                       int64_t columns) {
  p.block_table = table;
  p.max_blocks = columns;
  p.block_size = sizes[1];
  p.block_count = sizes[0];
}

}  // namespace opmesh::common
