#include "worker_times.h"

#include <atomic>
#include <mutex>

namespace opmesh::binding {
namespace {

std::atomic<bool> enabled{false};
std::mutex mutex;
std::vector<int64_t> last_times;

}  // namespace

void WorkerTimes::enable(bool on) { enabled = on; }

std::vector<int64_t> WorkerTimes::last() {
  std::lock_guard<std::mutex> lock(mutex);
  return last_times;
}

WorkerTimes::Recording::Recording(int64_t workers) {
  if (enabled) times_.assign(static_cast<size_t>(workers), 0);
}

WorkerTimes::Recording::~Recording() {
  if (times_.empty()) return;
  std::lock_guard<std::mutex> lock(mutex);
  last_times = std::move(times_);
}

}  // namespace opmesh::binding
