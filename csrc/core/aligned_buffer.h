// A 64-byte aligned, zero-filled scratch array (one cache line, one zmm register): AMX tile
// loads of rows that straddle cache lines run at less than half speed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace opmesh::core {

template <class T>
class AlignedBuffer {
 public:
  // Throws std::bad_alloc when the allocation fails or its size overflows; never holds null for
  // a non-zero count.
  explicit AlignedBuffer(size_t count) {
    if (count > (SIZE_MAX - 63) / sizeof(T)) throw std::bad_alloc();
    const size_t bytes = ((count * sizeof(T) + 63) / 64) * 64;
    void* p = bytes == 0 ? nullptr : std::aligned_alloc(64, bytes);
    if (bytes != 0 && p == nullptr) throw std::bad_alloc();
    if (bytes != 0) std::memset(p, 0, bytes);
    data_.reset(static_cast<T*>(p));
    count_ = count;
  }
  AlignedBuffer() : AlignedBuffer(0) {}
  T* data() const { return data_.get(); }
  // Grows to at least `count` elements; contents are not kept (a grown buffer is zero-filled).
  void grow(size_t count) {
    if (count > count_) *this = AlignedBuffer(count);
  }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
  size_t count_ = 0;
};

}  // namespace opmesh::core
