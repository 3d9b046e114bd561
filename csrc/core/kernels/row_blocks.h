// Register-blocking helper shared by the micro-kernels: visits rows [begin, end) in blocks of at
// most kRows, passing each block's height as a compile-time constant so each height gets its own
// fully unrolled code.
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

// Visits rows [begin, end) in the fewest blocks of at most kRows rows, their heights as even as
// possible (8 rows: 4 + 4, not 6 + 2): a block of a few rows has too few independent
// accumulators to hide the product's latency.
template <int kRows, class F>
inline void for_each_even_row_block(int begin, int end, F&& f) {
  const int m = end - begin;
  if (m <= 0) return;
  const int blocks = (m + kRows - 1) / kRows;
  int row = begin;
  for (int i = 0; i < blocks; ++i) {
    const int n = m / blocks + (i < m % blocks ? 1 : 0);
    visit_remainder<kRows>(n, row, f);
    row += n;
  }
}

}  // namespace opmesh::core::kernels
