// The torch binding's side of csrc/common/op_defs.h: each operator's call struct with torch types,
// its schema string, boxed kernels that read the struct off the dispatcher's stack, and calls of
// an operator from C++ with a struct. Every kernel (CPU, Meta, Autograd) is a function of the
// call struct, so an operator's argument list is written once, in op_defs.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <c10/core/SymInt.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "op_defs.h"

namespace opmesh::binding {

// The C++ type of each kind in the torch binding.
using TorchTypes = ops::BindingTypes<at::Tensor, at::Tensor, c10::SymInt>;

// The call struct of every operator with this binding's types (FlashAttnCall, ...).
#define OPMESH_ALIAS(Struct, op_name, LIST) using Struct = ops::Struct<TorchTypes>;
OPMESH_ALL_OPS(OPMESH_ALIAS)
#undef OPMESH_ALIAS

using Outputs2 = std::tuple<at::Tensor, at::Tensor>;
using Outputs4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The schema of Call's operator, e.g. "flash_attn(Tensor q, ..., *, ...) -> (...)".
std::string schema_of(const char* name, const std::vector<ops::Field>& fields,
                      const std::vector<std::string>& defaults, const char* returns);

namespace detail {

// IValue <-> field value.
inline void from_ivalue(const c10::IValue& v, at::Tensor& out) {
  out = v.isNone() ? at::Tensor() : v.toTensor();
}
inline void from_ivalue(const c10::IValue& v, double& out) { out = v.toDouble(); }
inline void from_ivalue(const c10::IValue& v, int64_t& out) { out = v.toInt(); }
inline void from_ivalue(const c10::IValue& v, bool& out) { out = v.toBool(); }
inline void from_ivalue(const c10::IValue& v, c10::SymInt& out) { out = v.toSymInt(); }
inline void from_ivalue(const c10::IValue& v, std::string& out) { out = v.toStringRef(); }
template <class T>
void from_ivalue(const c10::IValue& v, std::optional<T>& out) {
  if (v.isNone()) {
    out.reset();
  } else {
    T value{};
    from_ivalue(v, value);
    out = std::move(value);
  }
}

inline c10::IValue to_ivalue(const at::Tensor& v) { return v; }
inline c10::IValue to_ivalue(double v) { return v; }
inline c10::IValue to_ivalue(int64_t v) { return v; }
inline c10::IValue to_ivalue(bool v) { return v; }
inline c10::IValue to_ivalue(const c10::SymInt& v) { return v; }
inline c10::IValue to_ivalue(const std::string& v) { return v; }
template <class T>
c10::IValue to_ivalue(const std::optional<T>& v) {
  return v.has_value() ? to_ivalue(*v) : c10::IValue();
}

// A default value as the schema writes it.
std::string schema_literal(const at::Tensor&);
std::string schema_literal(double v);
std::string schema_literal(int64_t v);
std::string schema_literal(bool v);
std::string schema_literal(const c10::SymInt& v);
std::string schema_literal(const std::string& v);
template <class T>
std::string schema_literal(const std::optional<T>& v) {
  return v.has_value() ? schema_literal(*v) : "None";
}

inline void push_outputs(torch::jit::Stack& s, at::Tensor out) { s.emplace_back(std::move(out)); }
template <class... T>
void push_outputs(torch::jit::Stack& s, std::tuple<T...> outs) {
  std::apply([&](auto&... o) { (s.emplace_back(std::move(o)), ...); }, outs);
}

}  // namespace detail

template <class Call>
std::string schema_of() {
  const Call defaults{};
  std::vector<ops::Field> fields;
  std::vector<std::string> literals;
  defaults.visit([&](const ops::Field& f, const auto& value) {
    fields.push_back(f);
    literals.push_back(f.has_default ? detail::schema_literal(value) : std::string());
  });
  return schema_of(Call::kName, fields, literals, Call::kReturns);
}

// The call struct from the last kNumFields entries of a dispatcher stack.
template <class Call>
Call call_from_stack(c10::ArrayRef<c10::IValue> stack) {
  Call call;
  size_t i = stack.size() - Call::kNumFields;
  call.visit([&](const ops::Field&, auto& value) { detail::from_ivalue(stack[i++], value); });
  return call;
}

template <class Call>
void push_call(torch::jit::Stack& stack, const Call& call) {
  call.visit(
      [&](const ops::Field&, const auto& value) { stack.push_back(detail::to_ivalue(value)); });
}

// A boxed kernel running `Fn(const Call&)`: it pops the arguments and pushes the outputs.
template <class Call, auto Fn>
void boxed_kernel(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  Call call = call_from_stack<Call>(*stack);
  torch::jit::drop(*stack, Call::kNumFields);
  if constexpr (std::is_void_v<decltype(Fn(call))>) {
    Fn(call);
  } else {
    detail::push_outputs(*stack, Fn(call));
  }
}

// Registers Fn as Call's operator's kernel in a TORCH_LIBRARY_IMPL block.
template <class Call, auto Fn>
void impl(torch::Library& m) {
  m.impl(Call::kName, torch::CppFunction::makeFromBoxedFunction<&boxed_kernel<Call, Fn>>());
}

// Calls Call's operator through the dispatcher; the outputs as the stack left them.
template <class Call>
torch::jit::Stack call_op(const Call& call) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(
      (std::string("opmesh::") + Call::kName).c_str(), "");
  torch::jit::Stack stack;
  stack.reserve(Call::kNumFields);
  push_call(stack, call);
  op.callBoxed(stack);
  return stack;
}

// The outputs of a call as a tuple of N tensors.
template <size_t N>
auto tensors_of(const torch::jit::Stack& stack) {
  return [&]<size_t... I>(std::index_sequence<I...>) {
    return std::make_tuple(stack[I].toTensor()...);
  }(std::make_index_sequence<N>{});
}

}  // namespace opmesh::binding
