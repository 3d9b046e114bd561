// Run-time choice of the SIMD instruction set. One build runs on any x86-64 (and, with the
// portable path only, on other architectures); the OPMESH_SIMD_MAX environment variable caps the
// level so that every path can be exercised on a machine that supports more.
#pragma once

#include <string>
#include <vector>

namespace opmesh::core {

// Ordered: a higher level implies the lower ones are usable too.
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmxBf16 = 4 };

// Throws ArgumentError("isa") when this CPU (or OS) cannot run `isa`.
void require_supported(Isa isa);

const char* isa_name(Isa isa);
// Parses "scalar", "avx2", "avx512", "avx512_bf16", "amx_bf16"; throws ArgumentError(`what`)
// otherwise.
Isa parse_isa(const std::string& name, const char* what);
// The best level this CPU, its operating system and this build support.
Isa detected_isa();

// How the amx_bf16 level runs its tile operations:
//   kHardware: AMX instructions. Needs a build whose compiler accepted -mamx-tile -mamx-bf16,
//     CPUID AMX-TILE and AMX-BF16, tile state enabled by the OS (XCR0 bits 17 and 18) and
//     permission for this process to use it (arch_prctl ARCH_REQ_XCOMP_PERM, Linux).
//   kEmulated: a portable emulation of the same tile operations, for testing the AMX kernels'
//     blocking, packing and edge handling on any CPU with AVX-512 BF16. Only when the
//     environment variable OPMESH_AMX_TILES=emulate asks for it (it also wins over hardware).
//   kNone: the level is not available.
enum class AmxTiles : int { kNone = 0, kHardware = 1, kEmulated = 2 };
const char* amx_tiles_name(AmxTiles tiles);
// Whether the CPU, the OS and this build let the process use AMX tiles (checked once).
bool amx_hardware();
// The tile implementation the amx_bf16 level uses now (reads OPMESH_AMX_TILES on every call).
AmxTiles amx_tiles();

// Every level usable now, lowest first: the detected ones, plus amx_bf16 when emulated.
std::vector<Isa> supported_isas();
// Whether `isa` is one of supported_isas().
bool isa_supported(Isa isa);
// The best supported level, capped by OPMESH_SIMD_MAX if set.
Isa active_isa();

// This CPU's model as CPUID names it (brand string, family, model and stepping), for records
// kept per CPU model; "unknown" where there is no CPUID.
std::string cpu_identity();

}  // namespace opmesh::core
