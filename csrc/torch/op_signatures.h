// The C++ signatures of the operators called through the dispatcher from C++ (autograd.cpp,
// library.cpp); they must match the schemas in registration.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace opmesh::binding {

using FlashAttnSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, std::optional<double>,
    int64_t, int64_t, int64_t, std::optional<c10::SymInt>, std::optional<c10::SymInt>,
    c10::string_view, c10::string_view, c10::string_view, bool);

using KvCacheWriteSig = void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&);

}  // namespace opmesh::binding
