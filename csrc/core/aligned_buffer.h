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
  explicit AlignedBuffer(size_t count) : AlignedBuffer(count, true) {}
  AlignedBuffer() : AlignedBuffer(0) {}
  T* data() const { return data_.get(); }
  // Grows to at least `count` elements; contents are not kept (a grown buffer is zero-filled).
  void grow(size_t count) {
    if (count > count_) *this = AlignedBuffer(count);
  }
  // Grows to at least `count` elements whose contents are unspecified: for a buffer whose every
  // element is written before it is read (a large one would otherwise be zero-filled for nothing).
  // Sanitizer builds fill it with all-ones bytes (NaN as floats), so that a read of an element
  // never written shows in the results the tests check.
  void grow_uninitialized(size_t count) {
    if (count <= count_) return;
    *this = AlignedBuffer(count, false);
#if defined(__SANITIZE_ADDRESS__)
    if (count_ != 0) std::memset(data_.get(), 0xff, count_ * sizeof(T));
#endif
  }

 private:
  AlignedBuffer(size_t count, bool zero) {
    if (count > (SIZE_MAX - 63) / sizeof(T)) throw std::bad_alloc();
    const size_t bytes = ((count * sizeof(T) + 63) / 64) * 64;
    void* p = bytes == 0 ? nullptr : std::aligned_alloc(64, bytes);
    if (bytes != 0 && p == nullptr) throw std::bad_alloc();
    if (bytes != 0 && zero) std::memset(p, 0, bytes);
    data_.reset(static_cast<T*>(p));
    count_ = count;
  }
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
  size_t count_ = 0;
};

}  // namespace opmesh::core
