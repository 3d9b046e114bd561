// AMX tile operations (AMX-TILE, AMX-BF16) behind the interface of EmulatedTiles
// (tile_emulation.h). Every tile is configured as 16 rows x 64 bytes. Included only by the
// translation unit built with -mamx-tile -mamx-bf16.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace opmesh::core::kernels {

struct AmxTiles {
  static constexpr int kRows = 16;
  static constexpr int kRowBytes = 64;

  // The 64-byte operand of LDTILECFG.
  struct alignas(64) Config {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };
  // LDTILECFG reads palette at byte 0, start_row at 1, colsb at 16..47 and rows at 48..63.
  static_assert(sizeof(Config) == 64, "the tile configuration is 64 bytes");
  static_assert(offsetof(Config, colsb) == 16 && offsetof(Config, rows) == 48,
                "tile configuration layout");

  static bool& configured_flag() {
    static thread_local bool flag = false;
    return flag;
  }

  static void configure() {
    Config cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = kRowBytes;
      cfg.rows[t] = kRows;
    }
    // LDTILECFG through an asm statement whose memory operand is the whole 64-byte
    // configuration: GCC 12's _tile_loadconfig builtin does not tell the optimiser that it reads
    // the configuration, so the stores of colsb and rows were removed as dead and the tiles were
    // left with no rows (the first tile instruction then raised SIGILL on AMX hardware).
    asm volatile("ldtilecfg %0" : : "m"(cfg));
    configured_flag() = true;
  }
  static void release() {
    _tile_release();
    configured_flag() = false;
  }
  static bool configured() { return configured_flag(); }

  // GCC's tile intrinsics paste the register number into the instruction text, so it must be a
  // literal: each operation expands to one branch per register, resolved at compile time.
#define OPMESH_TILE_1(T, STMT)   \
  if constexpr (T == 0) {        \
    STMT(0);                     \
  } else if constexpr (T == 1) { \
    STMT(1);                     \
  } else if constexpr (T == 2) { \
    STMT(2);                     \
  } else if constexpr (T == 3) { \
    STMT(3);                     \
  } else if constexpr (T == 4) { \
    STMT(4);                     \
  } else if constexpr (T == 5) { \
    STMT(5);                     \
  } else if constexpr (T == 6) { \
    STMT(6);                     \
  } else {                       \
    static_assert(T == 7);       \
    STMT(7);                     \
  }
#define OPMESH_TILE_ZERO(t) _tile_zero(t)
#define OPMESH_TILE_LOAD(t) _tile_loadd(t, base, stride_bytes)
#define OPMESH_TILE_STORE(t) _tile_stored(t, base, stride_bytes)

  template <int T>
  static void zero() {
    OPMESH_TILE_1(T, OPMESH_TILE_ZERO)
  }
  template <int T>
  static void load(const void* base, int64_t stride_bytes) {
    OPMESH_TILE_1(T, OPMESH_TILE_LOAD)
  }
  template <int T>
  static void store(void* base, int64_t stride_bytes) {
    OPMESH_TILE_1(T, OPMESH_TILE_STORE)
  }
#undef OPMESH_TILE_ZERO
#undef OPMESH_TILE_LOAD
#undef OPMESH_TILE_STORE
#undef OPMESH_TILE_1

  // The (accumulator, A, B) register triples the amx_bf16 kernels use.
  template <int C, int A, int B>
  static void dpbf16() {
    if constexpr (C == 0 && A == 4 && B == 6) {
      _tile_dpbf16ps(0, 4, 6);
    } else if constexpr (C == 1 && A == 4 && B == 7) {
      _tile_dpbf16ps(1, 4, 7);
    } else if constexpr (C == 2 && A == 5 && B == 6) {
      _tile_dpbf16ps(2, 5, 6);
    } else if constexpr (C == 3 && A == 5 && B == 7) {
      _tile_dpbf16ps(3, 5, 7);
    } else if constexpr (C == 2 && A == 4 && B == 6) {
      _tile_dpbf16ps(2, 4, 6);
    } else {
      static_assert(C == 3 && A == 4 && B == 7, "add the register triple here");
      _tile_dpbf16ps(3, 4, 7);
    }
  }
};

}  // namespace opmesh::core::kernels
