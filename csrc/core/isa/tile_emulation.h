// A portable emulation of the AMX tile operations the amx_bf16 kernels use, with the same
// interface as AmxTiles (amx_tiles.h): eight tile registers of 16 rows x 64 bytes, loaded from
// and stored to strided memory, and TDPBF16PS (C[m][n] += sum over k of A[m][2k] * B[k][2n] +
// A[m][2k+1] * B[k][2n+1], bf16 products exact, accumulated in float32). It lets the kernels'
// blocking, packing and edge handling run and be tested on any machine.
#pragma once

#include <cstdint>
#include <cstring>

namespace opmesh::core::kernels {

struct EmulatedTiles {
  static constexpr int kRows = 16;
  static constexpr int kRowBytes = 64;

  static float widen(uint16_t bits) {
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float out;
    std::memcpy(&out, &wide, sizeof(out));
    return out;
  }

  struct alignas(64) Registers {
    uint8_t bytes[8][kRows][kRowBytes];
    bool configured = false;
  };
  static Registers& regs() {
    static thread_local Registers r;
    return r;
  }

  static void configure() { regs().configured = true; }
  static void release() { regs().configured = false; }
  static bool configured() { return regs().configured; }

  template <int T>
  static void zero() {
    std::memset(regs().bytes[T], 0, sizeof(regs().bytes[T]));
  }
  template <int T>
  static void load(const void* base, int64_t stride_bytes) {
    const char* p = static_cast<const char*>(base);
    for (int r = 0; r < kRows; ++r)
      std::memcpy(regs().bytes[T][r], p + r * stride_bytes, kRowBytes);
  }
  template <int T>
  static void store(void* base, int64_t stride_bytes) {
    char* p = static_cast<char*>(base);
    for (int r = 0; r < kRows; ++r)
      std::memcpy(p + r * stride_bytes, regs().bytes[T][r], kRowBytes);
  }
  // C (float32 [16][16]) += A (bf16 [16][32]) . B (bf16 pairs [16][16][2]).
  template <int C, int A, int B>
  static void dpbf16() {
    float c[kRows][16];
    uint16_t a[kRows][32];
    uint16_t b[kRows][32];
    std::memcpy(c, regs().bytes[C], sizeof(c));
    std::memcpy(a, regs().bytes[A], sizeof(a));
    std::memcpy(b, regs().bytes[B], sizeof(b));
    for (int m = 0; m < kRows; ++m) {
      for (int k = 0; k < 16; ++k) {
        const float a0 = widen(a[m][2 * k]);
        const float a1 = widen(a[m][2 * k + 1]);
        for (int n = 0; n < 16; ++n) {
          float acc = c[m][n];
          acc += a0 * widen(b[k][2 * n]);
          acc += a1 * widen(b[k][2 * n + 1]);
          c[m][n] = acc;
        }
      }
    }
    std::memcpy(regs().bytes[C], c, sizeof(c));
  }
};

}  // namespace opmesh::core::kernels
