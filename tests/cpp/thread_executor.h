// Executors on real threads, as the binding's pool provides, for the core tests.
#pragma once

#include <functional>
#include <thread>
#include <vector>

#include "executor.h"

namespace opmesh::core {

class ThreadExecutor final : public Executor {
 public:
  explicit ThreadExecutor(int n) : n_(n) {}
  int num_workers() const override { return n_; }
  void run_workers(const std::function<void(int)>& fn) const override {
    std::vector<std::thread> threads;
    for (int w = 0; w < n_; ++w) threads.emplace_back(fn, w);
    for (auto& t : threads) t.join();
  }

 private:
  int n_;
};

// A ThreadExecutor that counts the parallel regions it is asked to run (run_workers calls).
class CountingExecutor final : public Executor {
 public:
  explicit CountingExecutor(int n = 3) : threads_(n) {}
  int num_workers() const override { return threads_.num_workers(); }
  void run_workers(const std::function<void(int)>& fn) const override {
    ++regions;
    threads_.run_workers(fn);
  }
  mutable int regions = 0;

 private:
  ThreadExecutor threads_;
};

}  // namespace opmesh::core
