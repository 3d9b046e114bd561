// Optional per-logical-worker busy times of the last flash_attn call, for benchmarks that measure
// how well a plan balances on the real kernel. Off unless switched on from Python.
#pragma once

#include <cstdint>
#include <vector>

namespace opmesh::binding {

class WorkerTimes {
 public:
  static void enable(bool on);
  static std::vector<int64_t> last();

  // Collects one call's times while alive when recording is on; data() is nullptr otherwise.
  class Recording {
   public:
    explicit Recording(int64_t workers);
    ~Recording();
    int64_t* data() { return times_.empty() ? nullptr : times_.data(); }

   private:
    std::vector<int64_t> times_;
  };
};

}  // namespace opmesh::binding
