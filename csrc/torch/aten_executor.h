// Adapts PyTorch's intra-op thread pool to the core's Executor.
#pragma once

#include "executor.h"

namespace opmesh::binding {

class AtenExecutor final : public core::Executor {
 public:
  int num_workers() const override;
  void run_workers(const std::function<void(int)>& fn) const override;
};

}  // namespace opmesh::binding
