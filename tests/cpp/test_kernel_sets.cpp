// Every kernel set this machine can run, AMX tiles on their portable emulation included, against
// float64 references of the KernelSet contract (kernels/kernel_set.h): the attention GEMM with and
// without row scaling and the indexer's score tile, on sizes that do not fill whole blocks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "aligned_buffer.h"
#include "cpu_features.h"
#include "dtype.h"
#include "errors.h"
#include "kernel_choice.h"
#include "kernels/kernel_set.h"
#include "kernels/row_loads.h"

namespace opmesh::core::kernels {
namespace {

// Sets OPMESH_AMX_TILES for the lifetime of the object.
class AmxTilesEnv {
 public:
  explicit AmxTilesEnv(const char* value) { setenv("OPMESH_AMX_TILES", value, 1); }
  ~AmxTilesEnv() { unsetenv("OPMESH_AMX_TILES"); }
};

// Every set to test: the usable ones, plus the emulated AMX set where it can run.
std::vector<const KernelSet*> sets_under_test() {
  std::vector<const KernelSet*> out;
  const KernelSet* sets[16];
  const int n = available_sets(sets, 16);
  out.assign(sets, sets + n);
  const AmxTilesEnv env("emulate");
  if (const KernelSet* emulated = find_set(Isa::kAmxBf16, Word::kBf16Pair)) {
    out.push_back(emulated);
  }
  return out;
}

// Random values exactly representable in bf16, so float32 and bf16-pair sets see the same data.
float bf16_value(std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  return bf16_bits_to_float(float_to_bf16_bits(u(rng)));
}

// Packs a [rows][depth] float matrix (depth even for pairs) into words of the set's type.
void pack_rows(Word type, const std::vector<float>& x, int64_t rows, int64_t depth, int64_t words,
               uint32_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t w = 0; w < words; ++w) {
      uint32_t word = 0;
      if (type == Word::kFloat32) {
        const float v = w < depth ? x[r * depth + w] : 0.0f;
        std::memcpy(&word, &v, 4);
      } else {
        const float lo = 2 * w < depth ? x[r * depth + 2 * w] : 0.0f;
        const float hi = 2 * w + 1 < depth ? x[r * depth + 2 * w + 1] : 0.0f;
        word = float_to_bf16_bits(lo) | (static_cast<uint32_t>(float_to_bf16_bits(hi)) << 16);
      }
      out[r * words + w] = word;
    }
  }
}

// The workers' scope, as the operators open it.
struct Scope {
  explicit Scope(const KernelSet& s) : scope(s) {}
  WorkerScope scope;
};

void check_gemm(const KernelSet& set, int64_t m, int64_t n, int64_t depth, bool scaled) {
  SCOPED_TRACE(std::string(set.name) + " m " + std::to_string(m) + " n " + std::to_string(n) +
               " depth " + std::to_string(depth) + (scaled ? " scaled" : ""));
  std::mt19937 rng(static_cast<unsigned>(m * 1000 + n * 10 + depth));
  const bool pairs = set.word == Word::kBf16Pair;
  const int64_t words = round_up(pairs ? (depth + 1) / 2 : depth, set.depth_align);
  const int64_t rows = round_up(m, set.row_align);
  std::vector<float> a(m * depth), bt(n * depth), c0(m * n), scale(m);
  for (auto& v : a) v = bf16_value(rng);
  for (auto& v : bt) v = bf16_value(rng);
  for (auto& v : c0) v = bf16_value(rng);
  for (auto& v : scale) v = 0.5f + 0.5f * bf16_value(rng);
  AlignedBuffer<uint32_t> pa(rows * words), pb(words * n);
  pack_rows(set.word, a, m, depth, words, pa.data());
  // B packed [words][n]: word w of column j, the transpose of bt's packed rows.
  std::vector<uint32_t> bt_words(n * words);
  pack_rows(set.word, bt, n, depth, words, bt_words.data());
  for (int64_t j = 0; j < n; ++j)
    for (int64_t w = 0; w < words; ++w) pb.data()[w * n + j] = bt_words[j * words + w];
  const int64_t ldc = n + 16;
  std::vector<float> c(m * ldc, 0.0f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j) c[r * ldc + j] = c0[r * n + j];
  // gemm_rows on the same rows scattered (in reverse order, a gap of other words between them),
  // with those rows asked for ahead (a hint: any readable rows): the GEMM's bits.
  std::vector<float> gathered(c);
  std::vector<uint32_t> pool(m * (words + 7), 0x7FC17FC1u);
  std::vector<const void*> row_at(m);
  std::vector<const char*> ahead(m);
  for (int64_t r = 0; r < m; ++r) {
    uint32_t* dst = pool.data() + (m - 1 - r) * (words + 7);
    std::copy(pa.data() + r * words, pa.data() + (r + 1) * words, dst);
    row_at[r] = dst;
    ahead[r] = reinterpret_cast<const char*>(dst);
  }
  {
    const Scope scope(set);
    set.gemm({pa.data(), words, pb.data(), n, c.data(), ldc, m, n, words,
              scaled ? scale.data() : nullptr, 0.75f});
    if (set.gemm_rows != nullptr) {
      set.gemm_rows(row_at.data(), {nullptr, 0, pb.data(), n, gathered.data(), ldc, m, n, words,
                                    scaled ? scale.data() : nullptr, 0.75f,
                                    RowsAhead{ahead.data(), m, 4 * words}});
      ASSERT_EQ(0, std::memcmp(gathered.data(), c.data(), c.size() * sizeof(float)))
          << "gemm_rows differs from gemm";
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      double dot = 0;
      for (int64_t d = 0; d < depth; ++d) dot += double(a[r * depth + d]) * bt[j * depth + d];
      const double want = 0.75 * dot + (scaled ? double(scale[r]) * c0[r * n + j] : 0.0);
      ASSERT_NEAR(c[r * ldc + j], want, 1e-5 * (1 + std::abs(want))) << "row " << r << " col " << j;
    }
    for (int64_t j = n; j < ldc; ++j) ASSERT_EQ(c[r * ldc + j], 0.0f) << "wrote past n";
  }
}

TEST(KernelSets, RegistryDescribesWhatRunsHere) {
  const KernelSet* sets[16];
  const int n = available_sets(sets, 16);
  ASSERT_GE(n, 1);
  EXPECT_STREQ(sets[0]->name, "scalar");
  for (int i = 0; i < n; ++i) {
    const KernelSet& s = *sets[i];
    SCOPED_TRACE(s.name);
    EXPECT_TRUE(isa_supported(s.isa));
    EXPECT_GE(s.depth_align, 1);
    EXPECT_GE(s.row_align, 1);
    EXPECT_GE(s.row_block, 1);
    EXPECT_GE(s.block_tiles, 1);
    EXPECT_EQ(16 % s.block_tiles, 0) << "a block may not straddle a deterministic chunk";
    EXPECT_TRUE(s.accepts(DType::kBFloat16));
    EXPECT_EQ(s.accepts(DType::kFloat32), s.word == Word::kFloat32);
    EXPECT_EQ(s.to_bf16 != nullptr, s.word == Word::kBf16Pair);
    EXPECT_EQ(s.softmax_bf16 != nullptr, s.word == Word::kBf16Pair);
    EXPECT_NE(s.gemm, nullptr);
    EXPECT_NE(s.softmax, nullptr);
    EXPECT_NE(s.pack_keys, nullptr);
    EXPECT_NE(s.score_tile, nullptr);
    EXPECT_EQ(s.begin_worker == nullptr, s.end_worker == nullptr);
  }
  EXPECT_EQ(find_set(Isa::kAvx512, Word::kBf16Pair), nullptr);
  EXPECT_EQ(&float32_set(Isa::kScalar), sets[0]);
  // bf16 inputs take the float32 set when asked to, and fp32 inputs always do.
  const Isa best = active_isa();
  EXPECT_EQ(select_set(best, DType::kBFloat16, 0, true).word, Word::kFloat32);
  EXPECT_EQ(select_set(best, DType::kFloat32, 1, true).word, Word::kFloat32);
  if (static_cast<int>(best) >= static_cast<int>(Isa::kAvx512Bf16)) {
    EXPECT_EQ(select_set(best, DType::kBFloat16, 1, true).word, Word::kBf16Pair);
  }
}

TEST(KernelSets, AmxLevelOnlyWithTilesOrTheirEmulation) {
  {
    const AmxTilesEnv env("auto");
    EXPECT_EQ(isa_supported(Isa::kAmxBf16), amx_hardware());
    EXPECT_EQ(amx_tiles(), amx_hardware() ? AmxTiles::kHardware : AmxTiles::kNone);
  }
  const AmxTilesEnv env("emulate");
  if (detected_isa() < Isa::kAvx512Bf16) {
    EXPECT_EQ(amx_tiles(), AmxTiles::kNone);
    GTEST_SKIP() << "the tile emulation's softmax and packing need AVX-512 BF16";
  }
  EXPECT_EQ(amx_tiles(), AmxTiles::kEmulated);
  EXPECT_EQ(supported_isas().back(), Isa::kAmxBf16);
  const KernelSet* set = find_set(Isa::kAmxBf16, Word::kBf16Pair);
  ASSERT_NE(set, nullptr);
  EXPECT_STREQ(set->name, "amx_bf16/emulated");
  EXPECT_EQ(set->depth_align, 16);
  EXPECT_EQ(set->row_align, 16);
}

TEST(KernelSets, BadTileSettingIsRefusedByName) {
  const AmxTilesEnv env("always");
  try {
    amx_tiles();
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_EQ(std::string(e.what()).rfind("OPMESH_AMX_TILES:", 0), 0u) << e.what();
  }
}

// Sets or unsets an environment variable for the lifetime of the object, restoring it after.
class EnvVar {
 public:
  EnvVar(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value == nullptr) {
      unsetenv(name);
    } else {
      setenv(name, value, 1);
    }
  }
  ~EnvVar() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

TEST(KernelChoice, CalibrationFileFollowsTheCacheFolders) {
  {
    EnvVar dir("OPMESH_CACHE_DIR", "/tmp/a");
    EXPECT_EQ(bf16_calibration_path(), "/tmp/a/bf16_kernels.tsv");
  }
  {
    EnvVar dir("OPMESH_CACHE_DIR", "");
    EXPECT_EQ(bf16_calibration_path(), "");
  }
  EnvVar dir("OPMESH_CACHE_DIR", nullptr);
  {
    EnvVar xdg("XDG_CACHE_HOME", "/tmp/x");
    EXPECT_EQ(bf16_calibration_path(), "/tmp/x/opmesh/bf16_kernels.tsv");
  }
  EnvVar xdg("XDG_CACHE_HOME", nullptr);
  {
    EnvVar home("HOME", "/tmp/h");
    EXPECT_EQ(bf16_calibration_path(), "/tmp/h/.cache/opmesh/bf16_kernels.tsv");
  }
  EnvVar home("HOME", nullptr);
  EXPECT_EQ(bf16_calibration_path(), "");
  EXPECT_FALSE(cpu_identity().empty());
}

TEST(KernelChoice, CalibrateRefusesNoRoundsByName) {
  try {
    calibrate_bf16(Work::kCompute, active_isa(), 0);
    FAIL() << "expected ArgumentError";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("rounds:", 0), 0u) << e.what();
  }
}

TEST(KernelSets, GemmMatchesDoubleReferenceOnPartialBlocks) {
  for (const KernelSet* set : sets_under_test()) {
    for (int64_t m : {1, 5, 15, 16, 17, 31, 33, 64}) {
      for (int64_t n : {16, 48, 64}) {
        for (int64_t depth : {2, 30, 64, 130}) {
          check_gemm(*set, m, n, depth, m % 2 == 1);
          if (HasFatalFailure()) return;
        }
      }
    }
    check_gemm(*set, 63, 128, 128, true);  // a GQA tile of 21 positions x 3 heads, D = 128
  }
}

// Decode's scores from key rows in place (the sets that have them): every row count up to the
// set's limit, depths with and without a partial vector, keys a row stride apart with NaN in the
// words between them (which must not be read), and columns past kKeyTile left alone.
TEST(KernelSets, KeyScoresMatchDoubleReference) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  uint32_t nan_word;
  std::memcpy(&nan_word, &nan, 4);
  int tested = 0;
  for (const KernelSet* set : sets_under_test()) {
    if (set->key_scores == nullptr) continue;
    // A float32 set has no GEMM on keys as rows to fall back on: it takes every decode's rows.
    ASSERT_GE(set->key_scores_rows, set->word == Word::kFloat32 ? 16 : 1) << set->name;
    const bool floats = set->word == Word::kFloat32;  // float32 query rows, else bf16 pairs
    for (int64_t rows = 1; rows <= set->key_scores_rows; ++rows) {
      // 600: past the 256 words key_scores packs for 3 to 8 rows (its other path), and past the
      // 256 float32 elements a float32 set copies per row.
      // 2, 20, 254: 1, 2 and 3 words past a whole number of 4-word steps (the 4-row path).
      for (int64_t depth : {2, 16, 20, 80, 128, 254, 600}) {
        const int64_t words = depth / 2;
        const int64_t qwords = floats ? depth : words;
        // Query rows a few words apart, and 64, 128 or 256 apart: a float32 set reads those
        // where they lie, at offsets its instructions carry.
        for (int64_t ldq : {qwords + 3, int64_t{qwords <= 64 ? 64 : qwords <= 128 ? 128 : 256}}) {
          if (ldq < qwords) continue;
          SCOPED_TRACE(std::string(set->name) + " rows " + std::to_string(rows) + " depth " +
                       std::to_string(depth) + " ldq " + std::to_string(ldq));
          std::mt19937 rng(static_cast<unsigned>(rows * 1000 + depth));
          const int64_t ldk = words + 24;  // other heads' words between the keys
          const int64_t lds = kKeyTile + 16;
          std::vector<float> q(rows * depth), k(kKeyTile * depth);
          for (auto& v : q) v = bf16_value(rng);
          for (auto& v : k) v = bf16_value(rng);
          std::vector<uint32_t> q_words(rows * qwords), k_words(kKeyTile * words);
          pack_rows(set->word, q, rows, depth, qwords, q_words.data());
          pack_rows(Word::kBf16Pair, k, kKeyTile, depth, words, k_words.data());
          // Rows `ld` words apart with NaN in the words between them (not to be read); row i of
          // `count` from row(i).
          auto spread = [&](AlignedBuffer<uint32_t>& out, int64_t count, int64_t ld, int64_t n,
                            auto row) {
            std::fill(out.data(), out.data() + count * ld, nan_word);
            for (int64_t i = 0; i < count; ++i) std::memcpy(out.data() + i * ld, row(i), 4 * n);
          };
          AlignedBuffer<uint32_t> pq(rows * ldq), pk(kKeyTile * ldk);
          spread(pq, rows, ldq, qwords, [&](int64_t r) { return q_words.data() + r * qwords; });
          spread(pk, kKeyTile, ldk, words, [&](int64_t n) { return k_words.data() + n * words; });
          std::vector<float> s(rows * lds, -7.0f);
          {
            const Scope scope(*set);
            // Rows asked for ahead (any readable rows) change nothing the kernel computes.
            const char* ahead[2] = {reinterpret_cast<const char*>(pq.data()),
                                    reinterpret_cast<const char*>(pk.data())};
            set->key_scores({pq.data(), ldq, pk.data(), ldk, s.data(), lds, rows, words, 0.625f,
                             depth % 4 == 0 ? RowsAhead{ahead, 2, 4 * words} : RowsAhead{}});
          }
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t n = 0; n < kKeyTile; ++n) {
              double dot = 0;
              for (int64_t d = 0; d < depth; ++d)
                dot += double(q[r * depth + d]) * k[n * depth + d];
              const double want = 0.625 * dot;
              ASSERT_NEAR(s[r * lds + n], want, 1e-5 * (1 + std::abs(want)))
                  << "row " << r << " key " << n;
            }
            for (int64_t n = kKeyTile; n < lds; ++n)
              ASSERT_EQ(s[r * lds + n], -7.0f) << "wrote past";
          }
          // A row's scores do not depend on the other rows of its call: the same bits when the
          // other rows hold other values. A float32 set sums a row's products in one order for
          // every row count, so a row alone has the same bits too (a mesh that splits a key head's
          // query heads hands the kernel fewer rows); avx512_bf16/pairs keeps the order of one
          // row for two, and sums three to eight rows in lane groups (kernel_set.h).
          std::mt19937 other_rng(static_cast<unsigned>(rows * 1000 + depth + 7));
          std::vector<float> q_other(rows * depth);
          for (auto& v : q_other) v = bf16_value(other_rng);
          std::vector<uint32_t> other_words(rows * qwords);
          pack_rows(set->word, q_other, rows, depth, qwords, other_words.data());
          for (int64_t r = 0; r < rows; ++r) {
            AlignedBuffer<uint32_t> mixed(rows * ldq);
            spread(mixed, rows, ldq, qwords, [&](int64_t x) {
              return (x == r ? q_words.data() : other_words.data()) + x * qwords;
            });
            std::vector<float> shared(rows * lds), one(lds);
            {
              const Scope scope(*set);
              set->key_scores(
                  {mixed.data(), ldq, pk.data(), ldk, shared.data(), lds, rows, words, 0.625f, {}});
              set->key_scores({pq.data() + r * ldq,
                               ldq,
                               pk.data(),
                               ldk,
                               one.data(),
                               lds,
                               1,
                               words,
                               0.625f,
                               {}});
            }
            for (int64_t n = 0; n < kKeyTile; ++n) {
              ASSERT_EQ(std::memcmp(&shared[r * lds + n], &s[r * lds + n], 4), 0)
                  << "row " << r << " key " << n << " changed with the other rows";
              if (floats || rows <= 2) {
                ASSERT_EQ(std::memcmp(&one[n], &s[r * lds + n], 4), 0)
                    << "row " << r << " key " << n << " alone";
              }
            }
          }
          ++tested;
        }
      }
    }
  }
  if (tested == 0) GTEST_SKIP() << "no kernel set here has key_scores";
}

// Decode's P.V on value rows in place (the sets that have it): every row count up to 8 (16 on
// a float32 set, whose decode takes up to 16 rows), one tile and a block of six, the last rows
// missing (null: zeros), value rows a stride apart with NaN between them (not to be read), with
// and without the rescaling of the output. Against float64, and bit for bit against the set's
// GEMM on the same values packed (interleaved as key pairs on a pair set, widened to float32
// rows on a float32 set): the packed path it replaces.
TEST(KernelSets, ValueRowsEqualTheGemmOnPackedValues) {
  const uint16_t nan16 = 0x7FC1;
  int tested = 0;
  for (const KernelSet* set : sets_under_test()) {
    if (set->value_rows == nullptr) continue;
    const bool floats = set->word == Word::kFloat32;  // float32 P and value rows, else bf16 pairs
    for (int64_t rows = 1; rows <= (floats ? 16 : 8); ++rows) {
      for (int64_t count : {kKeyTile, 6 * kKeyTile}) {
        // 96 and 160: passes of 64 or 128 columns (few rows) and a last one of 32.
        for (int64_t dv : {32, 96, 128, 160}) {
          for (const bool rescale : {false, true}) {
            SCOPED_TRACE(std::string(set->name) + " rows " + std::to_string(rows) + " count " +
                         std::to_string(count) + " dv " + std::to_string(dv) +
                         (rescale ? " rescaled" : ""));
            std::mt19937 rng(static_cast<unsigned>(rows * 100 + count + dv + rescale));
            const int64_t present = count - 13;  // the last 13 rows past the keys
            const int64_t ldv = dv + 40;
            std::vector<uint16_t> pool(count * ldv, nan16);
            std::vector<const uint16_t*> values(count, nullptr);
            std::vector<float> v(count * dv, 0.0f);
            for (int64_t n = 0; n < present; ++n) {
              for (int64_t e = 0; e < dv; ++e) {
                v[n * dv + e] = bf16_value(rng);
                pool[n * ldv + e] = float_to_bf16_bits(v[n * dv + e]);
              }
              values[n] = pool.data() + n * ldv;
            }
            // P as bf16 pairs along the keys (float32 on a float32 set, with more bits than
            // bf16), zero where the keys are missing.
            std::vector<float> pr(rows * count, 0.0f);
            for (int64_t r = 0; r < rows; ++r) {
              for (int64_t n = 0; n < present; ++n) {
                pr[r * count + n] = std::abs(bf16_value(rng)) * (floats ? 1.0009765625f : 1.0f);
              }
            }
            const int64_t depth = floats ? count : count / 2;  // the GEMM's depth in words
            const int64_t ldp = depth + 5;
            AlignedBuffer<uint32_t> p(rows * ldp);
            for (int64_t r = 0; r < rows; ++r) {
              for (int64_t i = 0; i < depth; ++i) {
                if (floats) {
                  std::memcpy(&p.data()[r * ldp + i], &pr[r * count + i], 4);
                  continue;
                }
                p.data()[r * ldp + i] =
                    float_to_bf16_bits(pr[r * count + 2 * i]) |
                    (static_cast<uint32_t>(float_to_bf16_bits(pr[r * count + 2 * i + 1])) << 16);
              }
            }
            const int64_t ldo = dv + 16;
            std::vector<float> scale(rows), o0(rows * ldo);
            for (auto& x : scale) x = 0.25f + 0.5f * std::abs(bf16_value(rng));
            for (auto& x : o0) x = bf16_value(rng);
            std::vector<float> got(o0), packed_gemm(o0);
            // The packed path: value rows interleaved as key pairs (widened to float32 rows on
            // a float32 set), then the set's GEMM.
            const int64_t ldvp = dv + 16;
            AlignedBuffer<uint32_t> vp(depth * ldvp);
            std::fill(vp.data(), vp.data() + depth * ldvp, 0u);
            for (int64_t i = 0; i < depth; ++i) {
              if (floats) {
                if (values[i] != nullptr) std::memcpy(vp.data() + i * ldvp, &v[i * dv], 4 * dv);
                continue;
              }
              if (values[2 * i] == nullptr) continue;
              set->rows.interleave_bf16(values[2 * i], values[2 * i + 1], dv, vp.data() + i * ldvp);
            }
            {
              const Scope scope(*set);
              set->gemm({p.data(), ldp, vp.data(), ldvp, packed_gemm.data(), ldo, rows, dv, depth,
                         rescale ? scale.data() : nullptr, 1.0f});
              const char* ahead[1] = {reinterpret_cast<const char*>(pool.data())};
              set->value_rows({p.data(), ldp, values.data(), count, dv, got.data(), ldo,
                               rescale ? scale.data() : nullptr, rows,
                               RowsAhead{ahead, 1, 2 * dv}});
            }
            for (int64_t r = 0; r < rows; ++r) {
              for (int64_t e = 0; e < ldo; ++e) {
                uint32_t a = 0, b = 0;
                std::memcpy(&a, &got[r * ldo + e], 4);
                std::memcpy(&b, &packed_gemm[r * ldo + e], 4);
                ASSERT_EQ(a, b) << "row " << r << " column " << e;
                if (e >= dv) {
                  ASSERT_EQ(got[r * ldo + e], o0[r * ldo + e]) << "wrote past dv";
                  continue;
                }
                double want = rescale ? double(scale[r]) * o0[r * ldo + e] : 0.0;
                for (int64_t n = 0; n < count; ++n)
                  want += double(pr[r * count + n]) * v[n * dv + e];
                ASSERT_NEAR(got[r * ldo + e], want, 1e-5 * (1 + std::abs(want)))
                    << "row " << r << " column " << e;
              }
            }
            ++tested;
          }
        }
      }
    }
  }
  if (tested == 0) GTEST_SKIP() << "no kernel set here has value_rows";
}

TEST(KernelSets, RowsAheadAsksForEveryLineOnceInEvenShares) {
  std::vector<char> pool(256 * 1024);
  const uintptr_t base = (reinterpret_cast<uintptr_t>(pool.data()) + 63) & ~uintptr_t{63};
  for (int64_t count : {0, 1, 3, 8, 64}) {
    for (int64_t bytes : {1, 64, 100, 256, 2048}) {
      for (int64_t misalign : {0, 8, 63}) {
        for (int64_t steps : {1, 7, 16, 200}) {
          SCOPED_TRACE("count " + std::to_string(count) + " bytes " + std::to_string(bytes) +
                       " misalign " + std::to_string(misalign) + " steps " + std::to_string(steps));
          // Rows in descending address order, with gaps, so order and coverage both show.
          std::vector<const char*> rows(count);
          std::vector<uintptr_t> want;
          for (int64_t r = 0; r < count; ++r) {
            const uintptr_t first = base + (count - 1 - r) * (bytes / 64 + 3) * 64 + misalign;
            rows[r] = reinterpret_cast<const char*>(first);
            for (uintptr_t line = first & ~uintptr_t{63}; line < first + bytes; line += 64) {
              want.push_back(line);
            }
          }
          ASSERT_LE(want.empty() ? base : want.front(), base + pool.size() - 64);
          LinesAhead ahead(RowsAhead{rows.data(), count, bytes}, steps);
          std::vector<uintptr_t> got;
          size_t most = 0;
          for (int64_t step = 0; step < steps; ++step) {
            const size_t before = got.size();
            ahead.next([&](const char* line) { got.push_back(reinterpret_cast<uintptr_t>(line)); });
            most = std::max(most, got.size() - before);
          }
          EXPECT_EQ(got, want);  // every line, once, row by row, within the steps
          // An even share per step: at most the share of an upper bound on the lines.
          const size_t bound = count * ((bytes + 126) / 64);
          EXPECT_LE(most, (bound + steps - 1) / steps);
          ahead.next([&](const char*) { ADD_FAILURE() << "asked past the rows"; });
        }
      }
    }
  }
}

// The key tile's transpose: every valid row's words in its column, zeros in the others, nothing
// read past a row's words (NaN words after them) and nothing written past the tile's `words` rows.
TEST(KernelSets, PackKeysTransposesValidRowsAndZeroFillsTheRest) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  uint32_t nan_word;
  std::memcpy(&nan_word, &nan, 4);
  for (const KernelSet* set : sets_under_test()) {
    for (int64_t words : {1, 7, 8, 9, 16, 64, 67}) {
      for (int64_t valid : {0, 1, 7, 8, 33, 63, 64}) {
        SCOPED_TRACE(std::string(set->name) + " words " + std::to_string(words) + " valid " +
                     std::to_string(valid));
        const int64_t ld = words + 5;
        std::vector<uint32_t> src(kKeyTile * ld, nan_word);
        const char* rows[kKeyTile];
        for (int64_t n = 0; n < kKeyTile; ++n) {
          for (int64_t d = 0; d < words; ++d)
            src[n * ld + d] = static_cast<uint32_t>(n * 1000 + d + 1);
          rows[n] = reinterpret_cast<const char*>(src.data() + n * ld);
        }
        std::vector<uint32_t> kp((words + 1) * kKeyTile, 7u);
        set->pack_keys(rows, valid, words, kp.data());
        for (int64_t d = 0; d < words; ++d) {
          for (int64_t n = 0; n < kKeyTile; ++n) {
            const uint32_t want = n < valid ? static_cast<uint32_t>(n * 1000 + d + 1) : 0u;
            ASSERT_EQ(kp[d * kKeyTile + n], want) << "word " << d << " key " << n;
          }
        }
        for (int64_t n = 0; n < kKeyTile; ++n) ASSERT_EQ(kp[words * kKeyTile + n], 7u) << "past";
      }
    }
  }
}

// The conversion and the transpose in one pass: the same words as widen, then pack_keys, for
// every type, row length and count of valid rows, reading nothing past a row's elements.
TEST(KernelSets, PackWidenedKeysIsWidenThenPackKeys) {
  std::mt19937 rng(11);
  for (const KernelSet* set : sets_under_test()) {
    ASSERT_EQ(set->pack_widened_keys != nullptr, set->word == Word::kFloat32) << set->name;
    if (set->pack_widened_keys == nullptr) continue;
    for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat64, DType::kFloat32}) {
      const int64_t elem = dtype_size(dtype);
      for (int64_t n : {1, 7, 8, 15, 16, 17, 64, 130}) {
        for (int64_t valid : {0, 5, 16, 63, 64}) {
          SCOPED_TRACE(std::string(set->name) + " " + dtype_name(dtype) + " n " +
                       std::to_string(n) + " valid " + std::to_string(valid));
          // Each row alone in a buffer of its exact size: a read past it is a sanitizer error.
          std::vector<std::vector<char>> bytes(kKeyTile, std::vector<char>(n * elem));
          const char* rows[kKeyTile];
          for (int64_t r = 0; r < kKeyTile; ++r) {
            for (auto& b : bytes[r]) b = static_cast<char>(rng() & 0x3F);  // finite values
            rows[r] = bytes[r].data();
          }
          std::vector<float> wide(kKeyTile * n);
          const char* wide_rows[kKeyTile];
          for (int64_t r = 0; r < kKeyTile; ++r) {
            load_row(rows[r], dtype, 0, 1, n, wide.data() + r * n);
            wide_rows[r] = reinterpret_cast<const char*>(wide.data() + r * n);
          }
          std::vector<uint32_t> want(n * kKeyTile), got((n + 1) * kKeyTile, 9u);
          float32_set(Isa::kScalar).pack_keys(wide_rows, valid, n, want.data());
          set->pack_widened_keys(rows, valid, dtype, n, RowsAhead{rows, 3, n * elem}, got.data());
          ASSERT_EQ(std::memcmp(got.data(), want.data(), 4 * want.size()), 0);
          for (int64_t c = 0; c < kKeyTile; ++c) ASSERT_EQ(got[n * kKeyTile + c], 9u) << "past";
        }
      }
    }
  }
}

TEST(KernelSets, WidenIsExactForEveryTypeAndLength) {
  // Every fp16 and bf16 bit pattern once (normals, subnormals, infinities, NaNs), then doubles.
  std::vector<uint16_t> halves(65536);
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = static_cast<uint16_t>(i);
  std::vector<double> doubles{0.0, -0.0, 1e-300, 3.5, -1e300, 1.0 / 3.0, 7e-46, 65504.0};
  for (int i = 0; i < 40; ++i) doubles.push_back(std::ldexp(1.0 + i / 7.0, i - 20));
  for (const KernelSet* set : sets_under_test()) {
    for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat64, DType::kFloat32}) {
      const void* src = dtype == DType::kFloat64 ? static_cast<const void*>(doubles.data())
                                                 : static_cast<const void*>(halves.data());
      const int64_t total = dtype == DType::kFloat64   ? static_cast<int64_t>(doubles.size())
                            : dtype == DType::kFloat32 ? 32768
                                                       : 65536;
      for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{15}, int64_t{17}, total}) {
        std::vector<float> got(n + 1, 42.0f), want(n);
        set->widen(src, dtype, n, got.data());
        load_row(src, dtype, 0, 1, n, want.data());
        for (int64_t i = 0; i < n; ++i) {
          if (want[i] != want[i]) {
            ASSERT_NE(got[i], got[i]) << set->name << " " << dtype_name(dtype) << " " << i;
          } else {
            ASSERT_EQ(std::memcmp(&got[i], &want[i], 4), 0)
                << set->name << " " << dtype_name(dtype) << " element " << i;
          }
        }
        ASSERT_EQ(got[n], 42.0f) << set->name << " wrote past n";
      }
    }
  }
}

TEST(KernelSets, ExpRowsMatchesDoubleReference) {
  const float inf = std::numeric_limits<float>::infinity();
  for (const KernelSet* set : sets_under_test()) {
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-30.0f, 0.0f);
    const int64_t rows = 5, cols = 48;
    std::vector<float> s(rows * cols), shift{0.0f, 3.5f, -2.0f, inf, 80.0f};
    for (auto& x : s) x = u(rng);
    s[3] = -inf;                     // a masked score
    s[cols + 7] = shift[1] + 1e-6f;  // rounding may put a score just above its log-sum-exp
    // Exponentials in float32's subnormal range: 0 instead (a subnormal operand sends every
    // product that reads it to microcode assists).
    for (int64_t c = 0; c < 6; ++c) s[2 * cols + 20 + c] = shift[2] - 88.0f - 3.0f * c;
    std::vector<float> got = s;
    set->exp_rows(got.data(), rows, cols, shift.data());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const float y = got[r * cols + c];
        ASSERT_FALSE(y != 0.0f && std::abs(y) < std::numeric_limits<float>::min())
            << set->name << " subnormal at row " << r << " col " << c;
        const double x = double(s[r * cols + c]) - double(shift[r]);
        const double want = std::exp(x);
        // The kernels subtract in float32: |x| * 2^-24 of relative error before the exponential.
        const double rel = std::isinf(x) ? 0.0 : 1e-6 + std::abs(x) * 6e-8;
        // Results near float32's smallest normal may flush to 0 (the AVX2 exp does below -87).
        const double tiny = 2.0 * std::numeric_limits<float>::min();
        ASSERT_NEAR(got[r * cols + c], want, rel * want + tiny)
            << set->name << " row " << r << " col " << c;
      }
    }
  }
}

// The backward reaches the probabilities two ways: exp_rows with the log-sum-exp as the shift,
// or RowOps::shift_and_mask and then exp_rows with a zero shift. Both must give the same bits,
// or a sequence's gradients would depend on which way its batch's plan takes.
TEST(KernelSets, ExpRowsShiftedEqualsShiftAndMaskThenExp) {
  const float inf = std::numeric_limits<float>::infinity();
  for (const KernelSet* set : sets_under_test()) {
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> u(-25.0f, 3.0f);
    const int64_t rows = kKeyTile, cols = 16;
    std::vector<float> score(rows), lse(rows), zeros(rows, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      score[r] = u(rng);
      lse[r] = score[r] + std::abs(u(rng)) * 0.7f;
    }
    lse[5] = inf;
    std::vector<int64_t> lo(rows, 0), hi(rows, 1);
    std::vector<float> shifted(score);  // one key column: shift_and_mask, then exp
    set->rows.shift_and_mask(shifted.data(), lse.data(), lo.data(), hi.data(), 0);
    std::vector<float> via_mask(rows * cols), direct(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        via_mask[r * cols + c] = shifted[r];
        direct[r * cols + c] = score[r];
      }
    }
    set->exp_rows(via_mask.data(), rows, cols, zeros.data());
    set->exp_rows(direct.data(), rows, cols, lse.data());
    EXPECT_EQ(via_mask, direct) << set->name;
  }
}

// first_above against the plain loop: every length around the vector and block widths, the
// first score through at every place (or none), NaN scores and a NaN limit (everything through).
TEST(KernelSets, FirstAboveFindsTheFirstScoreTheCutOffLetsThrough) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto want = [](const std::vector<float>& s, int64_t n, float limit) {
    for (int64_t c = 0; c < n; ++c) {
      if (!(s[c] <= limit)) return c;
    }
    return n;
  };
  for (const KernelSet* set : sets_under_test()) {
    SCOPED_TRACE(set->name);
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> u(-4.0f, 1.0f);
    for (const int64_t n : {0, 1, 7, 16, 31, 32, 33, 63, 64, 65, 100}) {
      SCOPED_TRACE(n);
      for (int64_t through = -1; through < n; ++through) {
        std::vector<float> s(n + 8, 9.0f);  // past n: would pass
        for (int64_t c = 0; c < n; ++c) s[c] = u(rng);
        const float limit = 1.0f;
        if (through >= 0) s[through] = (through % 3 == 0) ? nan : 1.5f;
        if (through > 0) s[through - 1] = limit;  // equal to the limit: held back
        EXPECT_EQ(set->rows.first_above(s.data(), n, limit), want(s, n, limit)) << through;
      }
      std::vector<float> s(n, -1.0f);
      EXPECT_EQ(set->rows.first_above(s.data(), n, nan), int64_t{0});  // the first, or n = 0
      EXPECT_EQ(set->rows.first_above(s.data(), n, -std::numeric_limits<float>::infinity()),
                want(s, n, -std::numeric_limits<float>::infinity()));
    }
  }
}

// sign_scale from bits against masked_scale from the scores those bits record: the same bits
// for every shift, with negative, zero, infinite and NaN gradients and weights of both signs.
TEST(KernelSets, SignScaleGivesMaskedScalesBitsFromKeptSigns) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const KernelSet* set : sets_under_test()) {
    SCOPED_TRACE(set->name);
    std::mt19937 rng(17);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    std::vector<uint8_t> bytes(kKeyTile);
    for (auto& x : bytes) x = static_cast<uint8_t>(rng());
    std::vector<float> d(kKeyTile);
    for (auto& x : d) x = u(rng);
    d[3] = -0.0f;
    d[4] = 0.0f;
    d[5] = inf;
    d[6] = -inf;
    d[7] = nan;
    for (const float w : {0.75f, -1.5f, 0.0f, inf}) {
      for (int shift = 0; shift < 8; ++shift) {
        std::vector<float> s(kKeyTile), want(kKeyTile, 7.0f), got(kKeyTile, 7.0f);
        for (int64_t c = 0; c < kKeyTile; ++c) {
          s[c] = ((bytes[c] >> shift) & 1) != 0 ? 0.5f : (c % 2 == 0 ? -0.5f : 0.0f);
        }
        set->rows.masked_scale(s.data(), d.data(), w, want.data());
        set->rows.sign_scale(bytes.data(), shift, d.data(), w, got.data());
        for (int64_t c = 0; c < kKeyTile; ++c) {
          uint32_t a = 0, b = 0;
          std::memcpy(&a, &want[c], 4);
          std::memcpy(&b, &got[c], 4);
          EXPECT_EQ(a, b) << "w " << w << " shift " << shift << " entry " << c;
        }
      }
    }
  }
}

// sign_pairs against the three row operations it stands for: sign_scale per head, bf16_residual
// and pair_rows over consecutive heads (a zero head after an odd count), for one key at a time:
// the same bits at every head count up to 64, with special gradients, weights and ties.
TEST(KernelSets, SignPairsGiveTheBitsOfSignScaleResidualAndPairRows) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const KernelSet* set : sets_under_test()) {
    SCOPED_TRACE(set->name);
    std::mt19937 rng(23);
    std::uniform_real_distribution<float> u(-3.0f, 3.0f);
    for (const int64_t n : {1, 2, 7, 8, 9, 15, 16, 17, 20, 33, 48, 63, 64}) {
      SCOPED_TRACE(n);
      std::vector<float> w(n);
      for (auto& x : w) x = u(rng);
      w[0] = 1.0f + 1.0f / 256.0f;  // times d = 1: a tie
      if (n > 3) w[3] = inf;
      if (n > 5) w[5] = -0.0f;
      for (const float d : {1.0f, 0.37f, -2.5f, 0.0f, inf, nan, 1.0e-39f}) {
        std::vector<uint8_t> bits((n + 7) / 8 + 1);
        for (auto& b : bits) b = static_cast<uint8_t>(rng());
        // The composition: each head's coefficient from sign_scale (key 0 of a row of keys),
        // its residual, then the heads in pairs.
        std::vector<float> coef((n + 1) * kKeyTile, 0.0f), lo((n + 1) * kKeyTile, 0.0f);
        std::vector<float> dk(kKeyTile, 0.0f);
        dk[0] = d;
        for (int64_t h = 0; h < n; ++h) {
          std::vector<uint8_t> column(kKeyTile, 0);
          column[0] = bits[h / 8];
          set->rows.sign_scale(column.data(), static_cast<int>(h % 8), dk.data(), w[h],
                               coef.data() + h * kKeyTile);
          set->rows.bf16_residual(coef.data() + h * kKeyTile, lo.data() + h * kKeyTile);
        }
        const int64_t p = (n + 1) / 2;
        std::vector<uint32_t> want(2 * p), row(kKeyTile);
        for (int64_t l = 0; l < p; ++l) {
          set->rows.pair_rows(coef.data() + 2 * l * kKeyTile, coef.data() + (2 * l + 1) * kKeyTile,
                              row.data());
          want[l] = row[0];
          set->rows.pair_rows(lo.data() + 2 * l * kKeyTile, lo.data() + (2 * l + 1) * kKeyTile,
                              row.data());
          want[p + l] = row[0];
        }
        std::vector<uint32_t> got(2 * p + 8, 0xdeadbeefu);
        set->rows.sign_pairs(bits.data(), n, w.data(), d, got.data());
        for (int64_t l = 0; l < 2 * p; ++l)
          EXPECT_EQ(got[l], want[l]) << "d " << d << " word " << l;
        for (int64_t l = 2 * p; l < 2 * p + 8; ++l) EXPECT_EQ(got[l], 0xdeadbeefu) << l;
      }
    }
  }
}

// sign_weights against the selection written out (bit h picks weight h, a zero after an odd
// count, nothing written past the pairs), and add_scaled against its formula.
TEST(KernelSets, SignWeightsSelectTheWeightsAndAddScaledAdds) {
  for (const KernelSet* set : sets_under_test()) {
    SCOPED_TRACE(set->name);
    std::mt19937 rng(37);
    for (const int64_t n : {1, 2, 7, 8, 9, 31, 32, 33, 40, 63, 64}) {
      SCOPED_TRACE(n);
      std::vector<uint16_t> w(n);
      for (auto& x : w) x = static_cast<uint16_t>(rng() | 1u);  // never 0: a pick shows
      std::vector<uint8_t> bits((n + 7) / 8);
      for (auto& b : bits) b = static_cast<uint8_t>(rng());
      const int64_t p = (n + 1) / 2;
      std::vector<uint32_t> got(p + 4, 0xdeadbeefu);
      set->rows.sign_weights(bits.data(), n, w.data(), got.data());
      for (int64_t l = 0; l < p; ++l) {
        uint32_t want = 0;
        for (int64_t k = 0; k < 2; ++k) {
          const int64_t h = 2 * l + k;
          if (h < n && ((bits[h / 8] >> (h % 8)) & 1) != 0) want |= uint32_t{w[h]} << (16 * k);
        }
        EXPECT_EQ(got[l], want) << l;
      }
      for (int64_t l = p; l < p + 4; ++l) EXPECT_EQ(got[l], 0xdeadbeefu) << l;
    }
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (const int64_t n : {1, 16, 37, 128}) {
      std::vector<float> dst(n + 2, 7.0f), src(n);
      for (auto& x : src) x = u(rng);
      std::vector<float> want(dst);
      for (int64_t i = 0; i < n; ++i) want[i] += 0.3f * src[i];
      set->rows.add_scaled(dst.data(), src.data(), 0.3f, n);
      for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(dst[i], want[i], 1e-6f) << i;
      EXPECT_EQ(dst[n], 7.0f);
      EXPECT_EQ(dst[n + 1], 7.0f);
    }
  }
}

// coefficient_halves against split_coefficients: the halves are bf16 of its coefficient and of
// the coefficient's residual (the portable rounding: ties, NaN, infinities, subnormals), its sum
// the same sum to float rounding.
TEST(KernelSets, CoefficientHalvesSplitSplitCoefficients) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const KernelSet* set : sets_under_test()) {
    SCOPED_TRACE(set->name);
    std::mt19937 rng(31);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    std::vector<float> s(kKeyTile), d(kKeyTile);
    for (auto& x : s) x = u(rng);
    for (auto& x : d) x = u(rng);
    s[1] = 0.0f;
    s[2] = -0.0f;
    s[3] = nan;
    s[4] = inf;
    d[5] = 1.0f + 1.0f / 256.0f;  // times w = 1 a tie
    s[5] = 0.5f;
    d[6] = 1.0e-39f;  // a subnormal coefficient
    s[6] = 0.5f;
    for (const float w : {1.0f, -0.75f, 0.0f}) {
      std::vector<float> c1(kKeyTile), c2(kKeyTile);
      float a1 = 0.25f, a2 = 0.0f;
      set->rows.split_coefficients(s.data(), d.data(), d.data(), w, c1.data(), c2.data(), &a1, &a2);
      std::vector<uint16_t> out(2 * kKeyTile + 4, 0xbeefu);
      float a = 0.25f;
      set->rows.coefficient_halves(s.data(), d.data(), w, out.data(), &a);
      for (int64_t c = 0; c < kKeyTile; ++c) {
        const uint16_t hi = float_to_bf16_bits(c1[c]);
        const uint32_t wide = uint32_t{hi} << 16;
        float rounded;
        std::memcpy(&rounded, &wide, sizeof(rounded));
        EXPECT_EQ(out[c], hi) << "w " << w << " entry " << c;
        EXPECT_EQ(out[kKeyTile + c], float_to_bf16_bits(c1[c] - rounded)) << "w " << w << " " << c;
      }
      for (int64_t c = 2 * kKeyTile; c < 2 * kKeyTile + 4; ++c) EXPECT_EQ(out[c], 0xbeefu);
      if (std::isfinite(a1)) {
        EXPECT_NEAR(a, a1, 1e-5f * (1.0f + std::abs(a1))) << w;
      } else {
        EXPECT_EQ(a, a1) << w;  // the infinite score's term
      }
    }
  }
}

// sign_words against the comparison written out: bit h of column c is s[h][c] > 0 (zero, -0,
// NaN and -inf clear, +inf set), at head and column counts on and off the vector width, nothing
// written past n.
TEST(KernelSets, SignWordsHoldEachColumnsSigns) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float specials[] = {0.0f, -0.0f, nan, inf, -inf, 1.0e-40f, -1.0e-40f};
  for (const KernelSet* set : sets_under_test()) {
    SCOPED_TRACE(set->name);
    std::mt19937 rng(29);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (const int64_t heads : {1, 7, 8, 33, 64}) {
      for (const int64_t n : {0, 1, 15, 16, 17, 64, 100}) {
        SCOPED_TRACE(std::to_string(heads) + " heads, " + std::to_string(n) + " columns");
        const int64_t ld = n + 3;
        std::vector<float> s(heads * ld, 5.0f);  // past n in a row: positive, not read
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t c = 0; c < n; ++c) {
            s[h * ld + c] = (h + c) % 5 == 0 ? specials[(h * 3 + c) % 7] : u(rng);
          }
        }
        std::vector<uint64_t> got(n + 4, 0xabcdu);
        set->rows.sign_words(s.data(), ld, heads, n, got.data());
        for (int64_t c = 0; c < n; ++c) {
          uint64_t want = 0;
          for (int64_t h = 0; h < heads; ++h) {
            if (s[h * ld + c] > 0.0f) want |= uint64_t{1} << h;
          }
          EXPECT_EQ(got[c], want) << c;
        }
        for (int64_t c = n; c < n + 4; ++c) EXPECT_EQ(got[c], 0xabcdu) << c;
      }
    }
  }
}

// The bf16 row operations: rounding to nearest even (ties, NaN, infinities) as dtype.h rounds,
// interleaving, and the score modifications (softcap, ALiBi, the softcap's derivative) against
// double precision.
TEST(KernelSets, RowOpsForBf16PairsAndScoreModifications) {
  const float inf = std::numeric_limits<float>::infinity();
  constexpr int64_t kWidth = 64;
  for (const KernelSet* set : sets_under_test()) {
    SCOPED_TRACE(set->name);
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> u(-6.0f, 6.0f);
    std::vector<float> a(kWidth), b(kWidth);
    for (auto& x : a) x = u(rng);
    for (auto& x : b) x = u(rng);
    a[0] = 1.0f + 1.0f / 256.0f;  // a tie: rounds to even (1.0)
    a[1] = 1.0f + 3.0f / 256.0f;  // a tie: rounds up to even
    a[2] = std::numeric_limits<float>::quiet_NaN();
    a[3] = inf;
    b[4] = -inf;
    b[5] = 3.4e38f;  // rounds to infinity
    std::vector<uint32_t> pairs(kWidth);
    set->rows.pair_rows(a.data(), b.data(), pairs.data());
    for (int64_t c = 0; c < kWidth; ++c) {
      const uint32_t want_lo = float_to_bf16_bits(a[c]), want_hi = float_to_bf16_bits(b[c]);
      EXPECT_EQ(pairs[c], want_lo | (want_hi << 16)) << "pair_rows " << c;
    }
    // interleave_bf16, with and without a second row: lengths of whole vectors and not (a tail
    // within the first 16 entries of a vector and past them), nothing written past n.
    for (const int64_t n : {int64_t{1}, int64_t{16}, int64_t{37}, int64_t{53}, int64_t{128}}) {
      SCOPED_TRACE(n);
      std::vector<uint16_t> r0(n), r1(n);
      for (int64_t e = 0; e < n; ++e) {
        r0[e] = static_cast<uint16_t>(rng());
        r1[e] = static_cast<uint16_t>(rng());
      }
      std::vector<uint32_t> out(n + 40, 0xdeadbeefu);
      set->rows.interleave_bf16(r0.data(), r1.data(), n, out.data());
      for (int64_t e = 0; e < n; ++e) EXPECT_EQ(out[e], r0[e] | (uint32_t{r1[e]} << 16)) << e;
      for (int64_t e = n; e < n + 40; ++e) EXPECT_EQ(out[e], 0xdeadbeefu) << e;
      set->rows.interleave_bf16(r0.data(), nullptr, n, out.data());
      for (int64_t e = 0; e < n; ++e) EXPECT_EQ(out[e], uint32_t{r0[e]}) << e;
      for (int64_t e = n; e < n + 40; ++e) EXPECT_EQ(out[e], 0xdeadbeefu) << e;
    }
    // store_bf16: the portable conversion's bits after the scale (ties, NaN, infinities, a
    // subnormal), at a length that is not a whole vector, nothing written past it.
    std::vector<float> row(a.begin(), a.begin() + 37);
    row[6] = 1.0e-39f;  // subnormal
    std::vector<uint16_t> stored(40, 0xbeefu);
    for (const float scale : {1.0f, 0.37f}) {
      set->rows.store_bf16(row.data(), scale, 37, stored.data());
      for (int64_t e = 0; e < 37; ++e) {
        EXPECT_EQ(stored[e], float_to_bf16_bits(row[e] * scale)) << "store_bf16 " << e;
      }
      EXPECT_EQ(stored[37], 0xbeefu);
    }
    // score_mods: softcap with its derivative, then ALiBi in both directions.
    for (const float cap : {0.0f, 0.7f, 30.0f}) {
      for (const int64_t dir : {int64_t{-1}, int64_t{1}}) {
        std::vector<float> s(a.begin(), a.end()), deriv(kWidth, -1.0f);
        s[2] = u(rng);
        s[3] = 80.0f;  // saturates the cap
        const std::vector<float> x = s;
        const float slope = 0.125f;
        const int64_t dist0 = 20;
        set->rows.score_mods(s.data(), cap, slope, dist0, dir, deriv.data());
        for (int64_t c = 0; c < kWidth; ++c) {
          double want = x[c];
          double dwant = 1.0;
          if (cap > 0.0f) {
            const double t = std::tanh(double(x[c]) / cap);
            want = cap * t;
            dwant = 1.0 - t * t;
          }
          want -= slope * std::abs(double(dist0 + dir * c));
          EXPECT_NEAR(s[c], want, 2e-6 * (1.0 + std::abs(want))) << cap << " " << dir << " " << c;
          if (cap > 0.0f) EXPECT_NEAR(deriv[c], dwant, 1e-6) << cap << " " << c;
        }
        if (cap == 0.0f) EXPECT_EQ(deriv[0], -1.0f);  // no cap: the derivative is not written
      }
    }
    std::vector<float> d(a), f(b);
    d[2] = 1.0f;
    set->rows.multiply_into(d.data(), f.data());
    for (int64_t c = 3; c < kWidth; ++c) EXPECT_EQ(d[c], a[c] * b[c]) << c;
  }
}

// softmax_bf16 is softmax followed by to_bf16, bit for bit, without touching the scores'
// buffer beyond reading it.
TEST(KernelSets, SoftmaxToBf16IsSoftmaxThenRounding) {
  const float inf = std::numeric_limits<float>::infinity();
  for (const KernelSet* set : sets_under_test()) {
    if (set->word != Word::kBf16Pair) continue;
    SCOPED_TRACE(set->name);
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> u(-20.0f, 5.0f);
    const int64_t rows = 4, cols = 128;
    std::vector<float> s(rows * cols);
    for (auto& x : s) x = u(rng);
    for (int64_t c = 0; c < cols; ++c) s[2 * cols + c] = -inf;  // a row that sees nothing
    s[3 * cols + 5] = -inf;
    std::vector<float> m{-inf, 1.5f, -inf, 30.0f}, l{0.0f, 2.0f, 0.0f, 1.0f};
    std::vector<float> m2 = m, l2 = l, c1(rows), c2(rows), s2 = s;
    std::vector<uint16_t> want(rows * cols), got(rows * cols);
    set->softmax(s.data(), rows, cols, m.data(), l.data(), c1.data());
    set->to_bf16(s.data(), want.data(), rows * cols);
    set->softmax_bf16(s2.data(), rows, cols, 1.0f, m2.data(), l2.data(), c2.data(), got.data());
    EXPECT_EQ(want, got);
    EXPECT_EQ(m, m2);
    EXPECT_EQ(l, l2);
    EXPECT_EQ(c1, c2);
  }
}

// softmax_bf16 with a scale is the softmax of the scaled scores: the same running maximum (a
// positive scale keeps the order), sums and probabilities to float32 rounding.
TEST(KernelSets, SoftmaxBf16FoldsAPositiveScale) {
  const float inf = std::numeric_limits<float>::infinity();
  const float scale = 0.37f;
  for (const KernelSet* set : sets_under_test()) {
    if (set->word != Word::kBf16Pair) continue;
    SCOPED_TRACE(set->name);
    std::mt19937 rng(6);
    std::uniform_real_distribution<float> u(-40.0f, 12.0f);
    const int64_t rows = 3, cols = 192;
    std::vector<float> raw(rows * cols);
    for (auto& x : raw) x = u(rng);
    raw[7] = -inf;
    std::vector<float> scaled(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) scaled[i] = scale * raw[i];
    std::vector<float> m{-inf, 2.0f, 9.0f}, l{0.0f, 1.5f, 3.0f};
    std::vector<float> m2 = m, l2 = l, c1(rows), c2(rows);
    std::vector<uint16_t> want(rows * cols), got(rows * cols);
    set->softmax(scaled.data(), rows, cols, m.data(), l.data(), c1.data());
    set->to_bf16(scaled.data(), want.data(), rows * cols);
    set->softmax_bf16(raw.data(), rows, cols, scale, m2.data(), l2.data(), c2.data(), got.data());
    EXPECT_EQ(m, m2);
    for (int64_t r = 0; r < rows; ++r) {
      EXPECT_NEAR(l2[r], l[r], 1e-6f * l[r]) << r;
      EXPECT_NEAR(c2[r], c1[r], 1e-6f * c1[r]) << r;
    }
    for (size_t i = 0; i < got.size(); ++i) {
      // bf16 neighbours at most: the two exponentials differ by float32 rounding only.
      EXPECT_LE(std::abs(int(got[i]) - int(want[i])), 1) << i;
    }
  }
}

TEST(KernelSets, ScoreTileMatchesDoubleReference) {
  constexpr int kCapacity = 32;
  for (const KernelSet* set : sets_under_test()) {
    for (int groups : {1, 3}) {
      for (int64_t depth : {7, 64, 100}) {
        for (auto [begin, end] : {std::pair{0, 32}, {5, 21}, {17, 32}, {0, 1}, {3, 3}}) {
          SCOPED_TRACE(std::string(set->name) + " groups " + std::to_string(groups) + " depth " +
                       std::to_string(depth) + " rows " + std::to_string(begin) + ".." +
                       std::to_string(end));
          std::mt19937 rng(static_cast<unsigned>(groups * 100 + depth + begin));
          const bool pairs = set->word == Word::kBf16Pair;
          const int64_t words = round_up(pairs ? (depth + 1) / 2 : depth, set->depth_align);
          std::vector<float> q(groups * kCapacity * depth), k(kKeyTile * depth);
          std::vector<float> w(kCapacity * groups), before(kCapacity * kKeyTile);
          for (auto& v : q) v = bf16_value(rng);
          for (auto& v : k) v = bf16_value(rng);
          for (auto& v : w) v = bf16_value(rng);
          for (auto& v : before) v = bf16_value(rng);
          AlignedBuffer<uint32_t> pq(groups * kCapacity * words), pk(words * kKeyTile);
          pack_rows(set->word, q, groups * kCapacity, depth, words, pq.data());
          std::vector<uint32_t> k_words(kKeyTile * words);
          pack_rows(set->word, k, kKeyTile, depth, words, k_words.data());
          for (int64_t j = 0; j < kKeyTile; ++j)
            for (int64_t x = 0; x < words; ++x)
              pk.data()[x * kKeyTile + j] = k_words[j * words + x];
          std::vector<float> scores = before;
          {
            const Scope scope(*set);
            set->score_tile({pq.data(), kCapacity, pk.data(), w.data(), scores.data(), begin, end,
                             groups, words});
          }
          for (int r = 0; r < kCapacity; ++r) {
            for (int64_t j = 0; j < kKeyTile; ++j) {
              double want = before[r * kKeyTile + j];
              if (r >= begin && r < end) {
                for (int h = 0; h < groups; ++h) {
                  double dot = 0;
                  for (int64_t d = 0; d < depth; ++d) {
                    dot += double(q[(h * kCapacity + r) * depth + d]) * k[j * depth + d];
                  }
                  want += double(w[r * groups + h]) * std::max(dot, 0.0);
                }
              }
              ASSERT_NEAR(scores[r * kKeyTile + j], want, 1e-5 * (1 + std::abs(want)))
                  << "row " << r << " key " << j;
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace opmesh::core::kernels
