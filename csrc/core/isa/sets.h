// The kernel sets built into the library, one function per translation unit under isa/, and the
// shared pieces one set borrows from another. Each is compiled with its own instruction-set
// flags, so only functions of a set the CPU supports may be called.
#pragma once

#include <cstdint>

#include "../kernels/kernel_set.h"

namespace opmesh::core::kernels {

namespace scalar {
const KernelSet& kernel_set();
void pack_keys(const char* const* rows, int64_t valid, int64_t words, uint32_t* kp);
void widen(const void* src, DType dtype, int64_t n, float* dst);
void pack_widened_keys(const char* const* rows, int64_t valid, DType dtype, int64_t n,
                       const RowsAhead& ahead, uint32_t* kp);
}  // namespace scalar

#if defined(__x86_64__)
namespace avx2 {
const KernelSet& kernel_set();
}  // namespace avx2

namespace avx512 {
const KernelSet& kernel_set();
void softmax(float* s, int64_t rows, int64_t cols, float* m, float* l, float* correction);
void exp_rows(float* s, int64_t rows, int64_t cols, const float* shift);
void pack_keys(const char* const* rows, int64_t valid, int64_t words, uint32_t* kp);
void widen(const void* src, DType dtype, int64_t n, float* dst);
}  // namespace avx512

namespace avx512_bf16 {
const KernelSet& kernel_set();
void to_bf16(const float* src, uint16_t* dst, int64_t n);
void softmax_bf16(float* s, int64_t rows, int64_t cols, float scale, float* m, float* l,
                  float* correction, uint16_t* p16);
}  // namespace avx512_bf16

// amx_bf16 on a portable emulation of the tile operations (tile_emulation.h).
namespace amx_emulated {
const KernelSet& kernel_set();
}  // namespace amx_emulated

#if defined(OPMESH_HAVE_AMX)
// amx_bf16 on AMX instructions; built when the compiler accepts -mamx-tile -mamx-bf16.
namespace amx_bf16 {
const KernelSet& kernel_set();
}  // namespace amx_bf16
#endif
#endif

}  // namespace opmesh::core::kernels
