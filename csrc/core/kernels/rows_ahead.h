// Rows a caller reads next, asked for from memory while a kernel computes on rows in cache.
//
// Decode reads every cached key and value row once, and its products on rows in cache run faster
// than memory delivers them, so the two only add up unless the next rows are on their way while
// the current ones compute. The hardware prefetchers follow a sequential stream but not the
// strided slices that one key head of an interleaved cache reads, and a burst of software
// prefetches is partly dropped once the core's outstanding misses are full. So a kernel given a
// RowsAhead asks for its cache lines a few at a time, an even share between the steps of its own
// loop, as prefetch hints into L2.
#pragma once

#include <cstdint>

namespace opmesh::core::kernels {

struct RowsAhead {
  const char* const* rows = nullptr;  // the rows' addresses
  int64_t count = 0;                  // rows
  int64_t bytes = 0;                  // bytes read from each row's address
};

// Share k of `parts` even shares of a's rows: rows [count k / parts, count (k + 1) / parts).
inline RowsAhead share(const RowsAhead& a, int64_t k, int64_t parts) {
  const int64_t r0 = a.count * k / parts;
  return {a.rows + r0, a.count * (k + 1) / parts - r0, a.bytes};
}

// The cache lines of a RowsAhead, an even share of them per call of next() over `steps` calls.
class LinesAhead {
 public:
  LinesAhead() = default;  // asks for nothing
  LinesAhead(const RowsAhead& ahead, int64_t steps) : a_(ahead) {
    if (a_.count > 0 && steps > 0) {
      const int64_t lines = a_.count * ((a_.bytes + 2 * kLine - 2) / kLine);  // an upper bound
      per_step_ = (lines + steps - 1) / steps;
      start_row();
    }
  }

  void next() {
    next([](const char* line) { __builtin_prefetch(line, 0, 1); });  // into L2
  }

  // The same step, handing each line's address to ask (the tests record them).
  template <class Ask>
  void next(Ask&& ask) {
    for (int64_t i = 0; i < per_step_ && row_ < a_.count; ++i) {
      ask(reinterpret_cast<const char*>(line_));
      line_ += kLine;
      if (line_ >= end_) {
        ++row_;
        start_row();
      }
    }
  }

 private:
  static constexpr uintptr_t kLine = 64;

  void start_row() {
    if (row_ >= a_.count) return;
    const uintptr_t first = reinterpret_cast<uintptr_t>(a_.rows[row_]);
    line_ = first & ~(kLine - 1);
    end_ = first + static_cast<uintptr_t>(a_.bytes);
  }

  RowsAhead a_;
  int64_t per_step_ = 0;
  int64_t row_ = 0;
  uintptr_t line_ = 0;
  uintptr_t end_ = 0;
};

}  // namespace opmesh::core::kernels
