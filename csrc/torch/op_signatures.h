// The C++ signatures of the operators called through the dispatcher from C++ (autograd.cpp,
// library.cpp), all of them here; they must match the schemas in registration.cpp (the
// dispatcher checks each against its schema when the call is first typed).
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

using KlResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

using BackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, std::optional<double>,
    int64_t, int64_t, int64_t, std::optional<c10::SymInt>, std::optional<c10::SymInt>,
    c10::string_view, c10::string_view, c10::string_view, const std::optional<at::Tensor>&);

using IndexerSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&,
                                                      const std::optional<at::Tensor>&,
                                                      const std::optional<at::Tensor>&,
                                                      c10::string_view, int64_t, int64_t, int64_t);

using KlSig = KlResult(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, double, const std::optional<at::Tensor>&,
                       const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                       const std::optional<at::Tensor>&, c10::string_view, int64_t, int64_t,
                       int64_t);

using KvCacheWriteSig = void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&);

}  // namespace opmesh::binding
