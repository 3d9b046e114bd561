// Run-time choice of the SIMD instruction set. One build runs on any x86-64 (and, with the
// portable path only, on other architectures); the OPMESH_SIMD_MAX environment variable caps the
// level so that every path can be exercised on a machine that supports more.
#pragma once

#include <string>
#include <vector>

namespace opmesh::core {

// Ordered: a higher level implies the lower ones are usable too.
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

const char* isa_name(Isa isa);
// Parses "scalar", "avx2", "avx512", "avx512_bf16"; throws ArgumentError(`what`) otherwise.
Isa parse_isa(const std::string& name, const char* what);
// The best level this CPU and this build support.
Isa detected_isa();
// Every level this CPU and build support, lowest first.
std::vector<Isa> supported_isas();
// min(detected_isa(), cap) where cap comes from OPMESH_SIMD_MAX if set.
Isa active_isa();

}  // namespace opmesh::core
