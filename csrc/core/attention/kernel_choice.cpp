#include "../kernel_choice.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "../cpu_features.h"
#include "../dtype.h"
#include "../errors.h"
#include "flash_attn.h"
#include "planner.h"

namespace opmesh::core {
namespace {

// What OPMESH_BF16_KERNELS says about `work`: 1 pairs, 0 fp32, -1 measure.
int from_environment(Work work) {
  const char* env = std::getenv("OPMESH_BF16_KERNELS");
  if (env == nullptr || *env == '\0') return -1;
  const std::string text(env);
  auto value = [](const std::string& v) {
    if (v == "pairs") return 1;
    if (v == "fp32") return 0;
    if (v == "auto") return -1;
    throw ArgumentError("OPMESH_BF16_KERNELS",
                        "expected auto, pairs, fp32 or "
                        "'compute=...,memory=...', got '" +
                            v + "'");
  };
  if (text.find('=') == std::string::npos) return value(text);
  int result = -1;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, end - start);
    const size_t eq = item.find('=');
    if (eq == std::string::npos) value(item);  // throws unless a plain value
    const std::string kind = item.substr(0, eq);
    if (kind != "compute" && kind != "memory") {
      throw ArgumentError("OPMESH_BF16_KERNELS",
                          "kinds are 'compute' and 'memory', got '" + kind + "' in '" + text + "'");
    }
    const int v = value(item.substr(eq + 1));
    if (kind == work_name(work)) result = v;
    start = end + 1;
  }
  return result;
}

// A deterministic bf16 tensor of `count` elements in [-1, 1).
std::vector<uint16_t> bf16_data(int64_t count, uint32_t seed) {
  std::vector<uint16_t> out(count);
  uint32_t state = seed;
  for (auto& x : out) {
    state = state * 1664525u + 1013904223u;
    const float f = static_cast<float>(state >> 8) / 8388608.0f - 1.0f;
    x = float_to_bf16_bits(f);
  }
  return out;
}

// Best of `runs` timings (ns) of one flash-attention problem with the pairs choice forced.
double time_problem(Work work, Isa isa, bool pairs, int runs) {
  namespace attn = attention;
  const bool decode = work == Work::kMemory;
  // Compute-bound: a short causal prefill. Memory-bound: one query row against a long cache.
  const int64_t heads_q = decode ? 4 : 2, heads_kv = 1, dim = 128;
  const int64_t s1 = decode ? 1 : 128, s2 = decode ? 1024 : 128;
  attn::PlanConfig c;
  c.num_heads_q = heads_q;
  c.num_heads_kv = heads_kv;
  c.head_dim = c.head_dim_v = dim;
  c.batch_size = 1;
  c.max_seqlen_q = s1;
  c.max_seqlen_kv = s2;
  c.mask_mode = decode ? attn::MaskMode::kNone : attn::MaskMode::kCausal;
  c.num_workers = 1;
  const std::vector<attn::Sequence> seqs = attn::resolve_sequences(c, attn::LengthArrays{});
  const attn::Plan plan = attn::make_plan(c, seqs);
  const std::vector<uint16_t> q = bf16_data(s1 * heads_q * dim, 1);
  const std::vector<uint16_t> k = bf16_data(s2 * heads_kv * dim, 2);
  const std::vector<uint16_t> v = bf16_data(s2 * heads_kv * dim, 3);
  std::vector<uint16_t> out(s1 * heads_q * dim);
  std::vector<float> workspace(std::max<int64_t>(1, attn::workspace_floats(c, plan)));
  attn::FlashAttnParams p;
  p.config = c;
  p.dtype = DType::kBFloat16;
  p.q = {q.data(), s1 * heads_q * dim, heads_q * dim, dim, 1};
  p.k = {k.data(), s2 * heads_kv * dim, heads_kv * dim, dim, 1};
  p.v = {v.data(), s2 * heads_kv * dim, heads_kv * dim, dim, 1};
  p.out.data = out.data();
  p.out.sb = s1 * heads_q * dim;
  p.out.ss = heads_q * dim;
  p.out.sn = dim;
  p.out.sd = 1;
  p.softmax_scale = 0.088f;
  p.bf16_pairs = pairs ? 1 : 0;
  const SerialExecutor serial;
  double best = 1e30;
  for (int r = 0; r <= runs; ++r) {  // the first run warms caches and is not counted
    const auto t0 = std::chrono::steady_clock::now();
    attn::flash_attn(p, seqs, plan, serial, isa, workspace.data(), nullptr);
    const auto t1 = std::chrono::steady_clock::now();
    if (r > 0) best = std::min(best, std::chrono::duration<double, std::nano>(t1 - t0).count());
  }
  return best;
}

// Interleaved best-of timings of both kernel choices over `rounds` rounds, so a frequency change
// or a neighbour's load hits both alike.
Bf16Choice measure(Work work, Isa isa, int rounds) {
  double pairs_ns = 1e30, fp32_ns = 1e30;
  for (int round = 0; round < rounds; ++round) {
    pairs_ns = std::min(pairs_ns, time_problem(work, isa, true, 2));
    fp32_ns = std::min(fp32_ns, time_problem(work, isa, false, 2));
  }
  Bf16Choice c;
  c.pairs = pairs_ns <= fp32_ns;
  c.source = "measured";
  c.pairs_ns = pairs_ns;
  c.fp32_ns = fp32_ns;
  return c;
}

// The calibration file keeps one decision per CPU model, level and kind of work, so that every
// process on the machine takes the same one (a measurement under a neighbour's load could
// otherwise decide a close case differently from one process to the next). A line:
//   <cpu identity> \t <level> \t <kind> \t pairs|fp32 \t <pairs ns> \t <fp32 ns>
// The level names the tile implementation at amx_bf16 (hardware and emulated tiles differ).
std::string level_key(Isa isa) {
  std::string key = isa_name(isa);
  if (isa == Isa::kAmxBf16) key += std::string("/") + amx_tiles_name(amx_tiles());
  return key;
}

std::string line_key(Work work, Isa isa) {
  return cpu_identity() + "\t" + level_key(isa) + "\t" + work_name(work) + "\t";
}

// The lines of the file, and whether it could be read.
std::vector<std::string> read_lines(const std::string& path) {
  std::vector<std::string> lines;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) lines.push_back(line);
  return lines;
}

bool read_calibration(Work work, Isa isa, Bf16Choice* out) {
  const std::string path = bf16_calibration_path();
  if (path.empty()) return false;
  const std::string key = line_key(work, isa);
  for (const std::string& line : read_lines(path)) {
    if (line.compare(0, key.size(), key) != 0) continue;
    std::istringstream rest(line.substr(key.size()));
    std::string choice;
    double pairs_ns = 0.0, fp32_ns = 0.0;
    if (!(rest >> choice >> pairs_ns >> fp32_ns) || (choice != "pairs" && choice != "fp32")) {
      return false;  // a damaged line: measure again (and rewrite it)
    }
    out->pairs = choice == "pairs";
    out->source = "calibration";
    out->pairs_ns = pairs_ns;
    out->fp32_ns = fp32_ns;
    return true;
  }
  return false;
}

// mkdir -p of the file's folder; false if it cannot be made.
bool make_folders(const std::string& path) {
  for (size_t at = path.find('/', 1); at != std::string::npos; at = path.find('/', at + 1)) {
    const std::string folder = path.substr(0, at);
    if (mkdir(folder.c_str(), 0755) != 0 && errno != EEXIST) return false;
  }
  return true;
}

// Replaces (or adds) this CPU's line for `work` and `isa`: written to a file of its own, then
// renamed over the old one, so a reader sees the old file or the new one, never half of one.
// Any failure (a read-only home, no HOME) leaves the file as it was: the choice still holds for
// this process.
void write_calibration(Work work, Isa isa, const Bf16Choice& c) {
  const std::string path = bf16_calibration_path();
  if (path.empty() || !make_folders(path)) return;
  const std::string key = line_key(work, isa);
  std::vector<std::string> lines;
  for (std::string& line : read_lines(path)) {
    if (line.compare(0, key.size(), key) != 0 && !line.empty()) lines.push_back(std::move(line));
  }
  std::ostringstream entry;
  entry << key << (c.pairs ? "pairs" : "fp32") << '\t' << c.pairs_ns << '\t' << c.fp32_ns;
  lines.push_back(entry.str());
  const std::string temporary = path + "." + std::to_string(getpid()) + ".tmp";
  {
    std::ofstream out(temporary, std::ios::trunc);
    for (const std::string& line : lines) out << line << '\n';
    if (!out.good()) {
      std::remove(temporary.c_str());
      return;
    }
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) std::remove(temporary.c_str());
}

bool has_pair_kernels(Isa isa) {
  return static_cast<int>(isa) >= static_cast<int>(Isa::kAvx512Bf16) && isa_supported(isa);
}

Bf16Choice without_pair_kernels() {
  Bf16Choice c;
  c.pairs = false;
  c.source = "no bf16-pair kernels at this level";
  return c;
}

struct Measured {
  std::once_flag once;
  Bf16Choice choice;
};

// One slot per (level, tile implementation, kind of work): the AMX level measures its hardware
// and its emulated tiles separately.
Measured& measured(Work work, Isa isa) {
  static Measured slots[3][2];
  int level = 0;
  if (isa == Isa::kAmxBf16) level = amx_tiles() == AmxTiles::kEmulated ? 2 : 1;
  return slots[level][static_cast<int>(work)];
}

}  // namespace

const char* work_name(Work work) { return work == Work::kMemory ? "memory" : "compute"; }

bool bf16_pairs_faster(Work work, Isa isa) { return bf16_choice(work, isa).pairs; }

Bf16Choice bf16_choice(Work work, Isa isa) {
  const int forced = from_environment(work);
  if (forced >= 0) {
    Bf16Choice c;
    c.pairs = forced == 1;
    c.source = "environment";
    return c;
  }
  if (!has_pair_kernels(isa)) return without_pair_kernels();
  Measured& m = measured(work, isa);
  std::call_once(m.once, [&] {
    if (read_calibration(work, isa, &m.choice)) return;
    m.choice = measure(work, isa, 2);
    write_calibration(work, isa, m.choice);
  });
  return m.choice;
}

std::string bf16_calibration_path() {
  const char* dir = std::getenv("OPMESH_CACHE_DIR");
  std::string folder;
  if (dir != nullptr) {
    folder = dir;  // set but empty: no file
    if (folder.empty()) return "";
  } else if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    folder = std::string(xdg) + "/opmesh";
  } else if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    folder = std::string(home) + "/.cache/opmesh";
  } else {
    return "";
  }
  return folder + "/bf16_kernels.tsv";
}

Bf16Choice calibrate_bf16(Work work, Isa isa, int rounds) {
  if (rounds < 1)
    throw ArgumentError("rounds", "expected at least 1, got " + std::to_string(rounds));
  if (!has_pair_kernels(isa)) return without_pair_kernels();
  Bf16Choice c = measure(work, isa, rounds);
  write_calibration(work, isa, c);
  return c;
}

}  // namespace opmesh::core
