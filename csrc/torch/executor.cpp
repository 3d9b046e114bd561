#include <ATen/Parallel.h>

#include "aten_executor.h"

namespace opmesh::binding {

int AtenExecutor::num_workers() const {
  // Inside an outer parallel region ATen runs nested work inline: one worker then.
  return at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
}

void AtenExecutor::run_workers(const std::function<void(int)>& fn) const {
  const int n = num_workers();
  if (n == 1) {
    fn(0);
    return;
  }
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) fn(static_cast<int>(w));
  });
}

}  // namespace opmesh::binding
