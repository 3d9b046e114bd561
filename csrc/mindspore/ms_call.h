// The MindSpore binding's side of csrc/common/op_defs.h: each operator's call struct with
// MindSpore types, filled from the keyword arguments of a binding function (the schema's names),
// so the binding's functions take one struct and the Python side passes arguments by name.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "ms_binding.h"
#include "op_defs.h"
#include "tensor_access.h"

namespace opmesh::ms_binding {

// An integer tensor the kernels read on the host (lengths, block tables, slots, plans), as host
// values: a flat list (1-D) or a list of rows (2-D, flattened here row by row).
struct HostInts {
  std::vector<int64_t> values;
  int64_t rows = 0;
  int64_t cols = 0;  // 1-D: the entry count
};

// The C++ type of each kind in the MindSpore binding.
using MsTypes = ops::BindingTypes<ms::Tensor, HostInts, int64_t>;

// The call struct of every operator with this binding's types (FlashAttnCall, ...).
#define OPMESH_ALIAS(Struct, op_name, LIST) using Struct = ops::Struct<MsTypes>;
OPMESH_ALL_OPS(OPMESH_ALIAS)
#undef OPMESH_ALIAS

// Host values of an optional integer argument (int64), as the binding's helpers take them.
inline IntList values_of(const std::optional<HostInts>& h) {
  if (!h.has_value()) return std::nullopt;
  return h->values;
}

namespace detail {

HostInts host_ints_from(const py::handle& value, const char* name);

template <class T>
void from_py(const py::handle& value, const char* name, T& out) {
  try {
    out = value.cast<T>();
  } catch (const py::cast_error&) {
    throw py::type_error(std::string(name) + ": cannot take a " +
                         std::string(py::str(py::type::of(value).attr("__name__"))));
  }
}
inline void from_py(const py::handle& value, const char* name, HostInts& out) {
  out = host_ints_from(value, name);
}
// Integers and bools are taken strictly (pybind11 would take True as 1 and any int as a bool):
// a bool where an int is declared, or anything but a bool, 0 or 1 where a bool is, is refused.
inline void from_py(const py::handle& value, const char* name, int64_t& out) {
  if (py::isinstance<py::bool_>(value)) {
    throw py::type_error(std::string(name) + ": expected an int, got a bool");
  }
  from_py<int64_t>(value, name, out);
}
inline void from_py(const py::handle& value, const char* name, bool& out) {
  if (py::isinstance<py::bool_>(value)) {
    out = value.cast<bool>();
    return;
  }
  if (py::isinstance<py::int_>(value)) {
    const auto v = value.cast<int64_t>();
    if (v == 0 || v == 1) {
      out = v == 1;
      return;
    }
  }
  throw py::type_error(std::string(name) + ": expected a bool (or 0 or 1), got " +
                       std::string(py::str(py::repr(value))));
}
template <class T>
void from_py(const py::handle& value, const char* name, std::optional<T>& out) {
  if (value.is_none()) {
    out.reset();
    return;
  }
  T v{};
  from_py(value, name, v);
  out = std::move(v);
}

}  // namespace detail

// The call's tensors in field order, an absent optional one left out: the runner's inputs.
template <class Call>
std::vector<ms::Tensor> inputs_of(const Call& call) {
  std::vector<ms::Tensor> in;
  call.visit([&](const ops::Field&, const auto& value) {
    using V = std::decay_t<decltype(value)>;
    if constexpr (std::is_same_v<V, ms::Tensor>) {
      in.push_back(value);
    } else if constexpr (std::is_same_v<V, std::optional<ms::Tensor>>) {
      if (value.has_value()) in.push_back(*value);
    }
  });
  return in;
}

// The call with its tensors replaced by the runner's `in` (ordered as inputs_of gave them), whose
// memory the kernel may read.
template <class Call>
Call with_inputs(Call call, const std::vector<ms::Tensor>& in) {
  size_t next = 0;
  call.visit([&](const ops::Field&, auto& value) {
    using V = std::decay_t<decltype(value)>;
    if constexpr (std::is_same_v<V, ms::Tensor>) {
      value = in[next++];
    } else if constexpr (std::is_same_v<V, std::optional<ms::Tensor>>) {
      if (value.has_value()) value = in[next++];
    }
  });
  return call;
}

// The binding's operators (module.cpp binds them), each a function of its call struct.
py::object indexer(const IndexerCall& call);
py::object indexer_grad_kl_loss(const KlLossCall& call);
py::object sparse_indexer_grad_kl_loss(const SparseKlLossCall& call);
py::object kv_cache_write(const KvCacheWriteCall& call);
py::object lightning_indexer(const LightningIndexerCall& call);
py::object sparse_flash_attention(const SparseFlashAttentionCall& call);
py::object sparse_flash_attention_backward(const SparseFlashAttentionBackwardCall& call);
py::object sparse_flash_mla(const SparseFlashMlaCall& call);
py::object sparse_flash_mla_backward(const SparseFlashMlaBackwardCall& call);
py::object compressor(const CompressorCall& call);
py::object compressor_backward(const CompressorBackwardCall& call);
std::vector<int64_t> flash_attn_metadata(const FlashAttnMetadataCall& call);
py::object flash_attn(const FlashAttnCall& call);
py::object flash_attn_backward(const FlashAttnBackwardCall& call);

// Call's struct from keyword arguments: every argument without a default must be given, and no
// name outside the operator's schema is accepted.
template <class Call>
Call call_from_kwargs(const py::kwargs& kwargs) {
  Call call;
  size_t used = 0;
  call.visit([&](const ops::Field& f, auto& value) {
    if (kwargs.contains(f.name)) {
      detail::from_py(kwargs[f.name], f.name, value);
      ++used;
    } else if (!f.has_default) {
      throw py::type_error(std::string(Call::kName) + ": missing argument " + f.name);
    }
  });
  if (used != kwargs.size()) {
    throw py::type_error(std::string(Call::kName) + ": an argument is not in its schema");
  }
  return call;
}

// Binds `fn(const Call&)` as a module function taking keyword arguments.
template <class Call, class Fn>
void def_op(py::module_& m, const char* name, Fn fn) {
  m.def(name, [fn](const py::kwargs& kwargs) { return fn(call_from_kwargs<Call>(kwargs)); });
}

}  // namespace opmesh::ms_binding

namespace opmesh::common {

// MindSpore tensors and host arrays as the code shared by the bindings reads them.
template <>
struct TensorAccess<ms::Tensor> {
  static const void* data(const ms::Tensor& t) { return t.GetDataPtr(); }
  static std::vector<int64_t> sizes(const ms::Tensor& t) { return t.shape(); }
  static std::vector<int64_t> strides(const ms::Tensor& t) { return ms_binding::strides_of(t); }
  static core::DType dtype(const ms::Tensor& t, const char* argument) {
    return ms_binding::core_dtype(t, argument);
  }
  static int64_t element_size(const ms::Tensor& t) { return ms_binding::element_bytes(t); }
  static core::CacheFormat cache_format(const ms::Tensor& t) { return ms_binding::cache_format(t); }
};

template <>
struct HostIntsAccess<ms_binding::HostInts> {
  static std::vector<int64_t> values(const ms_binding::HostInts& h) { return h.values; }
  static int64_t columns(const ms_binding::HostInts& h) { return h.cols; }
};

}  // namespace opmesh::common
