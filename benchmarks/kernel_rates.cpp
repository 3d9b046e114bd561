// Decode's product kernels (key_scores, value_rows) on one core against the peak of the
// instruction each kernel set multiplies with, measured here by a loop of independent
// accumulators: VDPBF16PS on zmm for a bf16-pair set, FMA on zmm (avx512) or ymm (avx2) for a
// float32 set. One line per (set, kernel, rows, where the rows lie), tab-separated:
//   set  kernel  rows  lie  ns  gflops  peak_gflops
// ns per call of 64 keys, D = 128; `lie`: "L1" (one tile, read again and again) or "L2" (16
// tiles in turn, 512 KiB of keys and values). benchmarks/bench_kernel_rates.py runs it and
// writes the table. `--quick`: a few calls each (ctest runs it so, to see every set run).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <vector>

#include "kernels/kernel_set.h"

namespace {

using opmesh::core::Isa;
using namespace opmesh::core::kernels;

constexpr int kAcc = 12;  // independent accumulators: more than latency x throughput
long g_peak_iters = 20000000;
double g_round_ns = 2e7;       // about 20 ms of calls per timing round
constexpr int64_t kDim = 128;  // head dim: 64 pair words
constexpr int64_t kWords = kDim / 2;

// Floating-point operations per nanosecond of `step`'s kAcc chains, best of three runs
// (`flops_per_op`: per instruction of a chain).
template <class Step>
double rate(Step step, double flops_per_op) {
  double best = 0;
  for (int round = 0; round < 3; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    step(g_peak_iters);
    const double ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, g_peak_iters * kAcc * flops_per_op / ns);
  }
  return best;
}

// The chains start apart (identical chains would be computed once) and their first lanes leave
// through a volatile store, so no step is dropped.
volatile float g_sink;

template <class V>
void start(V (&acc)[kAcc]) {
  float lanes[sizeof(V) / sizeof(float)];
  for (int i = 0; i < kAcc; ++i) {
    std::fill(std::begin(lanes), std::end(lanes), 1.0f + static_cast<float>(i));
    std::memcpy(&acc[i], lanes, sizeof(V));
  }
}

template <class V>
void keep(const V (&acc)[kAcc]) {
  float sum = 0, lane;
  for (const V& x : acc) {
    std::memcpy(&lane, &x, sizeof(lane));
    sum += lane;
  }
  g_sink = sum;
}

__attribute__((target("avx2,fma"))) void fma_ymm(long iters) {
  __m256 acc[kAcc];
  start(acc);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (__m256& x : acc) x = _mm256_fmadd_ps(x, _mm256_set1_ps(0.999f), _mm256_set1_ps(1e-3f));
  }
  keep(acc);
}

__attribute__((target("avx512f"))) void fma_zmm(long iters) {
  __m512 acc[kAcc];
  start(acc);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (__m512& x : acc) x = _mm512_fmadd_ps(x, _mm512_set1_ps(0.999f), _mm512_set1_ps(1e-3f));
  }
  keep(acc);
}

__attribute__((target("avx512f,avx512bf16"))) void dpbf16_zmm(long iters) {
  const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3f7f3f7f));
  const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3a833a83));
  __m512 acc[kAcc];
  start(acc);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (__m512& x : acc) x = _mm512_dpbf16_ps(x, a, b);
  }
  keep(acc);
}

// The peak GFLOP/s of the instruction `set` multiplies with; 0 for a set on tiles.
double peak_of(const KernelSet& set) {
  if (set.word == Word::kBf16Pair) {
    return set.isa == Isa::kAvx512Bf16 ? rate(dpbf16_zmm, 64.0) : 0.0;
  }
  if (set.isa == Isa::kAvx512 || set.isa == Isa::kAvx512Bf16 || set.isa == Isa::kAmxBf16) {
    return rate(fma_zmm, 32.0);
  }
  return set.isa == Isa::kAvx2 ? rate(fma_ymm, 16.0) : 0.0;
}

// Best of five rounds of ns per call, each round about g_round_ns of calls.
template <class Call>
double ns_per_call(Call call) {
  long reps = 16;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < reps; ++i) call(i);
    const double ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    if (ns > g_round_ns) break;
    reps *= 2;
  }
  double best = 1e300;
  for (int round = 0; round < 5; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < reps; ++i) call(i);
    best = std::min(
        best,
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
            reps);
  }
  return best;
}

// One output line: a kernel's time per call of 64 keys and its GFLOP/s against the peak.
void report(const KernelSet& set, const char* kernel, int64_t rows, const char* lie, double ns,
            double peak) {
  std::printf("%s\t%s\t%lld\t%s\t%.1f\t%.1f\t%.1f\n", set.name, kernel,
              static_cast<long long>(rows), lie, ns, 2.0 * rows * kKeyTile * kDim / ns, peak);
}

// bf16 bits of a value in [0.5, 1) from a counter (the products' values do not change their
// time; subnormals, which would, never occur).
uint16_t bf16_of(uint32_t i) { return static_cast<uint16_t>(0x3f00u | ((i * 2654435761u) >> 25)); }

void measure(const KernelSet& set, double peak) {
  const bool pairs = set.word == Word::kBf16Pair;
  constexpr int64_t kTiles = 16;
  std::vector<uint32_t> keys(kTiles * kKeyTile * kWords);
  std::vector<uint16_t> values(kTiles * kKeyTile * kDim);
  for (size_t i = 0; i < keys.size(); ++i) {
    keys[i] = bf16_of(2 * i) | (static_cast<uint32_t>(bf16_of(2 * i + 1)) << 16);
  }
  for (size_t i = 0; i < values.size(); ++i) values[i] = bf16_of(i + 7);
  std::vector<const uint16_t*> value_rows(values.size() / kDim);
  for (size_t r = 0; r < value_rows.size(); ++r) value_rows[r] = values.data() + r * kDim;
  // Queries: pair words on a pair set, float32 elements (2 per word) otherwise; P likewise.
  std::vector<uint32_t> query(16 * kDim), p(16 * kKeyTile);
  for (size_t i = 0; i < query.size(); ++i) {
    query[i] = pairs ? keys[i] : 0x3f000000u | ((i * 2654435761u) >> 9 & 0x7fffffu);
  }
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] = pairs ? 0x3c003c00u : 0x3c000000u | ((i * 2654435761u) >> 9 & 0x7fffffu);
  }
  std::vector<float> s(16 * kKeyTile), o(16 * kDim, 0.0f), scale(16, 1.0f);
  WorkerScope worker(set);
  for (int64_t rows : {1, 2, 4, 8}) {
    for (int64_t tiles : {int64_t{1}, kTiles}) {
      const char* lie = tiles == 1 ? "L1" : "L2";
      const int64_t ldq = pairs ? kWords : kDim;  // words on pairs, floats otherwise
      if (set.key_scores != nullptr && rows <= set.key_scores_rows) {
        const double ns = ns_per_call([&](long i) {
          set.key_scores({query.data(),
                          ldq,
                          keys.data() + (i % tiles) * kKeyTile * kWords,
                          kWords,
                          s.data(),
                          kKeyTile,
                          rows,
                          kWords,
                          1.0f,
                          {}});
        });
        report(set, "key_scores", rows, lie, ns, peak);
      }
      if (set.value_rows != nullptr) {
        const int64_t ldp = pairs ? kKeyTile / 2 : kKeyTile;
        const double ns = ns_per_call([&](long i) {
          set.value_rows({p.data(),
                          ldp,
                          value_rows.data() + (i % tiles) * kKeyTile,
                          kKeyTile,
                          kDim,
                          o.data(),
                          kDim,
                          scale.data(),
                          rows,
                          {}});
        });
        report(set, "value_rows", rows, lie, ns, peak);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--quick") == 0) {
    g_peak_iters = 1000;
    g_round_ns = 1e4;
  }
  const KernelSet* sets[16];
  const int n = available_sets(sets, 16);
  for (int i = 0; i < n; ++i) {
    if (sets[i]->key_scores == nullptr && sets[i]->value_rows == nullptr) continue;
    measure(*sets[i], peak_of(*sets[i]));
  }
  return 0;
}
