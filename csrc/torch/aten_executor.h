// Adapts PyTorch's intra-op thread pool to the core's Executor.
#pragma once

#include "backends/backend.h"
#include "executor.h"

namespace opmesh::binding {

class AtenExecutor final : public core::Executor {
 public:
  int num_workers() const override;
  void run_workers(const std::function<void(int)>& fn) const override;
};

// The kernels this binding runs: it registers its kernels for CPU tensors, so the CPU backend's
// (a CUDA build would register the same kernel functions for CUDA tensors and pick
// core::backend_for(core::Device::kCuda) there).
inline const core::Backend& cpu_kernels() { return core::backend_for(core::Device::kCpu); }

}  // namespace opmesh::binding
