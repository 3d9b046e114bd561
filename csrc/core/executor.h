// How the core runs independent work in parallel. The core never starts threads of its own: the
// caller hands it an Executor (PyTorch's intra-op pool in the binding, a serial one in tests).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>

namespace opmesh::core {

class Executor {
 public:
  virtual ~Executor() = default;
  // Number of workers run_workers() will call; at least 1.
  virtual int num_workers() const = 0;
  // Calls fn(worker) exactly once for every worker in [0, num_workers()), concurrently where the
  // implementation can, and returns when all calls have returned.
  virtual void run_workers(const std::function<void(int worker)>& fn) const = 0;
};

class SerialExecutor final : public Executor {
 public:
  int num_workers() const override { return 1; }
  void run_workers(const std::function<void(int)>& fn) const override { fn(0); }
};

// Runs fn(task, worker) for every task in [0, num_tasks). Workers pull tasks from a shared counter,
// so tasks listed most-expensive-first balance well even when their costs differ widely.
inline void run_dynamic(const Executor& executor, int64_t num_tasks,
                        const std::function<void(int64_t task, int worker)>& fn) {
  if (num_tasks <= 0) return;
  if (num_tasks == 1) {  // one task: no parallel region to start and wait for
    fn(0, 0);
    return;
  }
  std::atomic<int64_t> next{0};
  executor.run_workers([&](int worker) {
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < num_tasks;
         t = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(t, worker);
    }
  });
}

}  // namespace opmesh::core
