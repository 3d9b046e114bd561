// Register-blocking helper shared by the micro-kernels: visits rows [begin, end) in blocks of
// kRows, then one smaller block for the remainder, passing the block height as a compile-time
// constant so each height gets its own fully unrolled code.
#pragma once

#include <type_traits>

namespace opmesh::core::kernels {

template <int kRows, class F>
inline void visit_remainder(int count, int row, F& f) {
  if constexpr (kRows > 0) {
    if (count == kRows) {
      f(std::integral_constant<int, kRows>{}, row);
    } else {
      visit_remainder<kRows - 1>(count, row, f);
    }
  }
}

template <int kRows, class F>
inline void for_each_row_block(int begin, int end, F&& f) {
  int row = begin;
  for (; row + kRows <= end; row += kRows) f(std::integral_constant<int, kRows>{}, row);
  visit_remainder<kRows - 1>(end - row, row, f);
}

}  // namespace opmesh::core::kernels
