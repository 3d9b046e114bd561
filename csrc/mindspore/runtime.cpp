#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>

#include "element_types.h"
#include "ms_binding.h"

namespace opmesh::ms_binding {

core::DType core_dtype(const ms::Tensor& t, const char* argument) {
  static constexpr mindspore::TypeId kTags[] = {
      mindspore::kNumberTypeFloat32, mindspore::kNumberTypeBFloat16, mindspore::kNumberTypeFloat16,
      mindspore::kNumberTypeFloat64};
  const std::optional<core::DType> dtype = common::floating_dtype(t.data_type(), kTags);
  if (!dtype.has_value()) {
    throw pybind11::type_error(std::string(argument) +
                               ": expected float32, bfloat16, float16 or float64");
  }
  return *dtype;
}

core::CacheFormat cache_format(const ms::Tensor& t) {
  return t.data_type() == mindspore::kNumberTypeInt8 ? core::CacheFormat::kInt8
                                                     : core::CacheFormat::kPlain;
}

int64_t element_bytes(const ms::Tensor& t) {
  switch (t.data_type()) {
    case mindspore::kNumberTypeFloat64:
    case mindspore::kNumberTypeInt64:
      return 8;
    case mindspore::kNumberTypeFloat32:
    case mindspore::kNumberTypeInt32:
      return 4;
    case mindspore::kNumberTypeInt8:
      return 1;
    default:
      return 2;
  }
}

ms::Tensor new_tensor(mindspore::TypeId dtype, const std::vector<int64_t>& shape) {
  return ms::Tensor(dtype, ShapeVector(shape.begin(), shape.end()));
}

std::vector<int64_t> strides_of(const ms::Tensor& t) { return t.stride(); }

void require_entries(const IntList& values, int64_t count, const char* name) {
  if (values.has_value() && static_cast<int64_t>(values->size()) != count) {
    value_error(std::string(name) + ": expected " + std::to_string(count) + " entries, got " +
                std::to_string(values->size()));
  }
}

std::vector<int32_t> as_int32(const IntList& values) {
  if (!values.has_value()) return {};
  return std::vector<int32_t>(values->begin(), values->end());
}

ThreadExecutor::ThreadExecutor() {
  const char* env = std::getenv("OPMESH_NUM_THREADS");
  const int hardware = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  workers_ = env != nullptr && std::atoi(env) > 0 ? std::atoi(env) : hardware;
}

void ThreadExecutor::run_workers(const std::function<void(int)>& fn) const {
  if (workers_ == 1) {
    fn(0);
    return;
  }
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(workers_ - 1));
  for (int w = 1; w < workers_; ++w) threads.emplace_back(fn, w);
  fn(0);
  for (auto& t : threads) t.join();
}

void CoreRunner::LaunchKernel() {
  std::vector<ms::Tensor> in = inputs();
  std::vector<ms::Tensor> out = outputs();
  kernel_(in, out);
}

namespace {

// The kernel's hand-off between MindSpore's launch thread and the calling thread: the launch
// thread publishes the ready inputs and outputs and sleeps; the calling thread runs the kernel
// with the executor's workers and wakes it. MindSpore's own wait for an op spins, which would
// take a core from the kernel's workers, and its autograd was seen to read a custom op's output
// before the kernel finished: so the call returns only once its kernel has run.
struct Handoff {
  std::mutex mutex;
  std::condition_variable changed;
  const std::vector<ms::Tensor>* inputs = nullptr;
  std::vector<ms::Tensor>* outputs = nullptr;
  bool ready = false;    // the launch thread published inputs and outputs
  bool done = false;     // the calling thread ran the kernel
  bool dropped = false;  // the runner went away without launching (an input failed)
  std::thread::id caller = std::this_thread::get_id();
  std::exception_ptr error;

  // Runs the kernel, keeping what it throws for the calling thread.
  void run(const CoreRunner::Kernel& kernel, const std::vector<ms::Tensor>& in,
           std::vector<ms::Tensor>& out) {
    try {
      kernel(in, out);
    } catch (...) {
      error = std::current_exception();
    }
  }
};

// MindSpore's runner call for `count` outputs: the counts the operators have (N, More...).
template <size_t N, size_t... More, class Run>
py::object call_runner(size_t count, const std::string& name, const Run& run) {
  using Runner = ms::pynative::PyboostRunner;
  if (count == N) {
    if constexpr (N == 0) {
      return Runner::Call<0>(name, [run] { run(); });
    } else {
      return Runner::Call<N>(name, run);
    }
  }
  if constexpr (sizeof...(More) > 0) {
    return call_runner<More...>(count, name, run);
  } else {
    value_error("launch: unsupported output count " + std::to_string(count));
  }
}

}  // namespace

CoreRunner::~CoreRunner() {
  if (on_destroy_) on_destroy_();
}

py::object launch(const std::string& name, const std::vector<ms::Tensor>& inputs,
                  const std::vector<OutputSpec>& outputs, CoreRunner::Kernel kernel) {
  auto h = std::make_shared<Handoff>();
  CoreRunner::Kernel hand_over = [h, kernel](const std::vector<ms::Tensor>& in,
                                             std::vector<ms::Tensor>& out) {
    if (std::this_thread::get_id() == h->caller) {
      // MindSpore launched synchronously (pynative_synchronize): run here, nothing to hand over.
      h->run(kernel, in, out);
      std::lock_guard<std::mutex> lock(h->mutex);
      h->ready = h->done = true;
      return;
    }
    std::unique_lock<std::mutex> lock(h->mutex);
    h->inputs = &in;
    h->outputs = &out;
    h->ready = true;
    h->changed.notify_all();
    h->changed.wait(lock, [&] { return h->done; });
  };
  auto run = [name, inputs, outputs, hand_over, h]() {
    std::vector<ms::Tensor> made;
    for (const OutputSpec& o : outputs) made.push_back(new_tensor(o.dtype, o.shape));
    auto runner = std::make_shared<CoreRunner>(name, hand_over, [h] {
      std::lock_guard<std::mutex> lock(h->mutex);
      if (!h->ready) h->dropped = true;
      h->changed.notify_all();
    });
    runner->Run(inputs, made);
    return made;
  };
  py::object result = call_runner<0, 1, 2, 3, 4, 6>(outputs.size(), name, run);
  {
    py::gil_scoped_release released;
    std::unique_lock<std::mutex> lock(h->mutex);
    h->changed.wait(lock, [&] { return h->ready || h->dropped; });
    if (h->ready && !h->done) {
      h->run(kernel, *h->inputs, *h->outputs);
      h->done = true;
      h->changed.notify_all();
    }
  }
  if (h->error) std::rethrow_exception(h->error);
  if (!h->ready) {
    throw std::runtime_error(name +
                             ": the kernel was not launched (an input's computation failed)");
  }
  return result;
}

}  // namespace opmesh::ms_binding
