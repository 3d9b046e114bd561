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
  size_t size() const { return count_; }
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
  // A zero-filled buffer from calloc, which takes a large block zeroed from the system: its pages
  // are faulted in by whichever threads first write them (side by side in a parallel loop) rather
  // than written with zeros by the caller first.
  static AlignedBuffer lazily_zeroed(size_t count) {
    AlignedBuffer b;
    const size_t bytes = checked_bytes(count);
    if (bytes == 0) return b;
    char* base = static_cast<char*>(std::calloc(bytes + 64, 1));
    if (base == nullptr) throw std::bad_alloc();
    const size_t shift = 64 - reinterpret_cast<uintptr_t>(base) % 64;
    b.data_ = std::unique_ptr<T, Free>(reinterpret_cast<T*>(base + shift), Free{shift});
    b.count_ = count;
    return b;
  }

 private:
  // count elements in whole cache lines; throws std::bad_alloc when that overflows.
  static size_t checked_bytes(size_t count) {
    if (count > (SIZE_MAX - 127) / sizeof(T)) throw std::bad_alloc();
    return ((count * sizeof(T) + 63) / 64) * 64;
  }
  AlignedBuffer(size_t count, bool zero) {
    const size_t bytes = checked_bytes(count);
    void* p = bytes == 0 ? nullptr : std::aligned_alloc(64, bytes);
    if (bytes != 0 && p == nullptr) throw std::bad_alloc();
    if (bytes != 0 && zero) std::memset(p, 0, bytes);
    data_.reset(static_cast<T*>(p));
    count_ = count;
  }
  struct Free {
    size_t shift = 0;  // bytes from the block's start to the data (lazily_zeroed)
    void operator()(T* p) const { std::free(reinterpret_cast<char*>(p) - shift); }
  };
  std::unique_ptr<T, Free> data_;
  size_t count_ = 0;
};

}  // namespace opmesh::core
