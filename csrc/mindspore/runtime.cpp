#include <algorithm>
#include <cstdlib>
#include <thread>

#include "ms_binding.h"

namespace opmesh::ms_binding {

core::DType core_dtype(const ms::Tensor& t, const char* argument) {
  switch (t.data_type()) {
    case mindspore::kNumberTypeFloat32:
      return core::DType::kFloat32;
    case mindspore::kNumberTypeBFloat16:
      return core::DType::kBFloat16;
    case mindspore::kNumberTypeFloat16:
      return core::DType::kFloat16;
    case mindspore::kNumberTypeFloat64:
      return core::DType::kFloat64;
    default:
      throw pybind11::type_error(std::string(argument) +
                                 ": expected float32, bfloat16, float16 or float64");
  }
}

int64_t element_bytes(const ms::Tensor& t) {
  switch (t.data_type()) {
    case mindspore::kNumberTypeFloat64:
    case mindspore::kNumberTypeInt64:
      return 8;
    case mindspore::kNumberTypeFloat32:
    case mindspore::kNumberTypeInt32:
      return 4;
    default:
      return 2;
  }
}

ms::Tensor new_tensor(mindspore::TypeId dtype, const std::vector<int64_t>& shape) {
  return ms::Tensor(dtype, ShapeVector(shape.begin(), shape.end()));
}

std::vector<int64_t> strides_of(const ms::Tensor& t) { return t.stride(); }

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
  std::vector<ms::Tensor> out = outputs();
  kernel_(inputs(), out);
}

py::object launch(const std::string& name, const std::vector<ms::Tensor>& inputs,
                  const std::vector<OutputSpec>& outputs, CoreRunner::Kernel kernel) {
  auto run = [name, inputs, outputs, kernel]() {
    std::vector<ms::Tensor> made;
    for (const OutputSpec& o : outputs) made.push_back(new_tensor(o.dtype, o.shape));
    auto runner = std::make_shared<CoreRunner>(name, kernel);
    runner->Run(inputs, made);
    return made;
  };
  using Runner = ms::pynative::PyboostRunner;
  switch (outputs.size()) {
    case 0:
      return Runner::Call<0>(name, [run] { run(); });
    case 2:
      return Runner::Call<2>(name, run);
    case 4:
      return Runner::Call<4>(name, run);
    default:
      value_error("launch: unsupported output count " + std::to_string(outputs.size()));
  }
}

}  // namespace opmesh::ms_binding
