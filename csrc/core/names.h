// Names of the core's enumerations, each numbered 0, 1, ... in the order of its table.
#pragma once

#include <cstddef>

namespace opmesh::core {

// names[e], or `unknown` for a value past the table.
template <class E, std::size_t N>
const char* enum_name(E e, const char* const (&names)[N], const char* unknown) {
  const auto i = static_cast<std::size_t>(e);
  return i < N ? names[i] : unknown;
}

}  // namespace opmesh::core
