// Which kernels bf16 inputs use at the avx512_bf16 and amx_bf16 levels, chosen by measured speed.
//
// bf16 inputs can run on the level's bf16-pair kernels (VDPBF16PS, or AMX tiles at amx_bf16, on
// packed pairs: half the bytes moved) or be widened to float32 and run on FMA. Which is faster
// depends on the CPU: where VDPBF16PS runs at half the FMA rate (Intel Xeons), compute-bound work
// (prefill, the indexer) is faster on FMA while memory-bound work (decode) is faster on pairs; on
// AMD Zen 4 pairs win both. So the choice is made per level and kind of work by a short
// measurement of the real kernels and can be fixed by the environment variable
// OPMESH_BF16_KERNELS:
//   auto (default): measure;  pairs: always bf16 pairs;  fp32: always float32 FMA;
//   or per kind, e.g. "compute=fp32,memory=pairs" (an unnamed kind is measured).
// A measured decision is kept in a calibration file (bf16_calibration_path()) per CPU model,
// level and kind, and every later process on a CPU of that model takes it from there, so the
// choice does not change from process to process with the machine's load.
#pragma once

#include <string>

#include "cpu_features.h"

namespace opmesh::core {

enum class Work : int { kCompute = 0, kMemory = 1 };

const char* work_name(Work work);

// Whether bf16 inputs should use the bf16-pair kernels of level `isa` (avx512_bf16 or amx_bf16)
// for this kind of work. Thread-safe; the first call per level and kind may take a few
// milliseconds.
bool bf16_pairs_faster(Work work, Isa isa);

// The source of the last decision for `work`: "measured", "calibration" (the file),
// "environment" or "not decided yet";
// and the measured times (nanoseconds, best of several runs) of pairs and fp32, 0 when not
// measured. For diagnostics and benchmark records.
struct Bf16Choice {
  bool pairs = true;
  const char* source = "not decided yet";
  double pairs_ns = 0.0;
  double fp32_ns = 0.0;
};
Bf16Choice bf16_choice(Work work, Isa isa);

// Where the calibration file is: $OPMESH_CACHE_DIR/bf16_kernels.tsv (set but empty: no file),
// else $XDG_CACHE_HOME/opmesh/..., else $HOME/.cache/opmesh/...; "" when none applies.
std::string bf16_calibration_path();

// Measures both choices over `rounds` interleaved rounds (the default decision takes 2) and
// writes the result to the calibration file for later processes; the decision this process has
// already taken stays. Source "measured". Throws ArgumentError("rounds") below 1.
Bf16Choice calibrate_bf16(Work work, Isa isa, int rounds);

}  // namespace opmesh::core
