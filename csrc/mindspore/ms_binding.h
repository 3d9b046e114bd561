// Helpers of the MindSpore binding: MindSpore tensors as the core's operands, a thread executor,
// and the core's ArgumentError as a Python ValueError.
//
// The binding's functions are called by opmesh's MindSpore path (opmesh/platform/mindspore_ops.py)
// after the shape, dtype and argument checks shared with the torch binding have passed. Each
// function first runs, synchronously, every check that reads argument values (lengths, block
// tables, plans, slots; the core's own checks), so a bad value raises at the call; then it queues
// the op on MindSpore's pipeline and runs the kernel on the calling thread once MindSpore's launch
// thread hands over the ready inputs and outputs (launch(), runtime.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "dtype.h"
#include "errors.h"
#include "executor.h"
#include "ms_extension/api.h"

namespace py = pybind11;

namespace opmesh::ms_binding {

using IntList = std::optional<std::vector<int64_t>>;

// Runs f, turning the core's ArgumentError (message starting with the argument) into ValueError.
template <class F>
auto checked(F&& f) {
  try {
    return f();
  } catch (const core::ArgumentError& e) {
    throw pybind11::value_error(e.what());
  }
}

[[noreturn]] inline void value_error(const std::string& message) {
  throw pybind11::value_error(message);
}

// Resolves pending results (MindSpore's asynchronous "stub" tensors) so shapes can be read.
inline void resolve(std::initializer_list<const ms::Tensor*> tensors) {
  for (const ms::Tensor* t : tensors) t->ConvertStubNodeToTensor();
}
inline void resolve(const std::optional<ms::Tensor>& t) {
  if (t.has_value()) t->ConvertStubNodeToTensor();
}

// The binding runs after the checks shared with the torch binding; these guards only keep a
// direct call from reading past a tensor's shape or a host array's end.
inline void require_rank(const ms::Tensor& t, size_t rank, const char* name) {
  if (t.shape().size() != rank) {
    value_error(std::string(name) + ": expected " + std::to_string(rank) + " dims, got " +
                std::to_string(t.shape().size()));
  }
}
void require_entries(const IntList& values, int64_t count, const char* name);

// The floating types the kernels read; a TypeError naming `argument` otherwise.
core::DType core_dtype(const ms::Tensor& t, const char* argument);

// The quantized cache format of a cache tensor: int8, else plain (MindSpore's CPU tensors have no
// float8 type this binding takes).
core::CacheFormat cache_format(const ms::Tensor& t);

// The element type's size in bytes (floating types, int8, int32 and int64).
int64_t element_bytes(const ms::Tensor& t);

// A new MindSpore tensor of `dtype` and `shape` (memory given by the runner).
ms::Tensor new_tensor(mindspore::TypeId dtype, const std::vector<int64_t>& shape);

// Strides in elements of a runner input or output (after MindSpore made it contiguous).
std::vector<int64_t> strides_of(const ms::Tensor& t);

// int64 host values as int32 (ranges were checked by the Python layer), or empty.
std::vector<int32_t> as_int32(const IntList& values);

// The CPU's worker threads: OPMESH_NUM_THREADS, else the hardware's thread count.
// The kernels this binding runs (MindSpore's CPU tensors): the CPU backend's.
inline const core::Backend& cpu_kernels() { return core::backend_for(core::Device::kCpu); }

class ThreadExecutor final : public core::Executor {
 public:
  ThreadExecutor();
  int num_workers() const override { return workers_; }
  void run_workers(const std::function<void(int)>& fn) const override;

 private:
  int workers_;
};

// A MindSpore runner whose kernel is a closure: the closure gets the runner's inputs and outputs
// (their memory ready) and runs the core. `on_destroy` runs when the runner goes away.
class CoreRunner final : public ms::pynative::PyboostRunner {
 public:
  using Kernel =
      std::function<void(const std::vector<ms::Tensor>& inputs, std::vector<ms::Tensor>& outputs)>;
  CoreRunner(const std::string& name, Kernel kernel, std::function<void()> on_destroy)
      : PyboostRunner(name), kernel_(std::move(kernel)), on_destroy_(std::move(on_destroy)) {}
  ~CoreRunner() override;
  void LaunchKernel() override;

 private:
  Kernel kernel_;
  std::function<void()> on_destroy_;
};

// An output to create: its dtype and shape.
struct OutputSpec {
  mindspore::TypeId dtype;
  std::vector<int64_t> shape;
};

// Runs `kernel` over `inputs` into new outputs through MindSpore's op pipeline (the outputs are
// MindSpore's pending results, ordered with the ops before and after): a tuple of the outputs,
// or None when there are none.
py::object launch(const std::string& name, const std::vector<ms::Tensor>& inputs,
                  const std::vector<OutputSpec>& outputs, CoreRunner::Kernel kernel);

}  // namespace opmesh::ms_binding
