// sparse_flash_mla's plan (sparse_flash_mla_metadata). Work is enumerated in a canonical order:
// query row r of the batch (sequence by sequence), then key head g; a *unit* (r, g) is one row's
// selected keys for one key head, predicted to cost its keys plus a fixed overhead. Each logical
// worker gets one contiguous stretch of that order, from a begin position (unit, key) to an end
// position, so a unit is split along its keys at most where a stretch ends; the pieces of a split
// unit keep partial results that a combine step merges. Serialised into int32 words with
// everything the call must match (docs/ops/sparse_flash_mla.md, "Metadata"):
//
//   [0, kHeaderWords)        header (fields below; the nine arrays' prints, 3 words each)
//   kWorkerWords per worker  begin unit, begin key, end unit, end key, cost (float32 bits)
#pragma once

#include <cstdint>
#include <vector>

#include "../vocabulary.h"
#include "plan_words.h"
#include "sparse_attention_detail.h"
#include "sparse_flash_mla.h"

namespace opmesh::core::mla_plan {

inline constexpr int32_t kMagic = 0x4d4c4d4f;  // "OMLM" read as little-endian bytes
inline constexpr int32_t kVersion = 1;

// The per-sequence and per-row integer arrays a plan depends on, in header order.
enum Array : int {
  kCuQ = 0,
  kCuOri,
  kCuCmp,
  kUsedQ,
  kUsedOri,
  kUsedCmp,
  kResiduals,
  kOriTopkLength,
  kCmpTopkLength,
  kArrays
};
inline constexpr const char* kArrayNames[kArrays] = {
    "cu_seqlens_q",   "cu_seqlens_ori_kv", "cu_seqlens_cmp_kv", "seqused_q",      "seqused_ori_kv",
    "seqused_cmp_kv", "cmp_residual_kv",   "ori_topk_length",   "cmp_topk_length"};

// Every argument of sparse_flash_mla_metadata but the arrays.
struct Config {
  int64_t num_heads_q = 0;
  int64_t num_heads_kv = 0;
  int64_t head_dim = 0;
  int64_t batch_size = 0;
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_ori_kv = 0;
  int64_t max_seqlen_cmp_kv = 0;
  int64_t ori_topk = 0;
  int64_t cmp_topk = 0;
  int64_t cmp_ratio = 1;
  int64_t ori_mask_mode = 0;
  int64_t cmp_mask_mode = 0;
  int64_t ori_win_left = -1;
  int64_t ori_win_right = -1;
  Layout layout_q = Layout::kBSND;
  Layout layout_kv = Layout::kBSND;
  bool has_ori_kv = true;
  bool has_cmp_kv = true;
  int64_t num_workers = 1;
};

// The arrays on the host (nullptr: absent) and their entry counts.
struct Arrays {
  const int64_t* data[kArrays] = {};
  int64_t count[kArrays] = {};
};

// A position in the canonical order: unit u = row * N2 + g, and the key of the unit's selection
// where the position falls (0: the unit's start). The end is {units, 0}.
struct Position {
  int64_t unit = 0;
  int64_t key = 0;
};

struct Stretch {
  Position begin;
  Position end;  // exclusive
  float cost = 0;
};

struct Plan {
  Config config;
  int64_t rows = 0;  // query rows over all sequences (units: rows * N2)
  std::vector<Stretch> workers;
  plan_words::ArrayPrint prints[kArrays] = {};
  double makespan = 0;     // the largest stretch's cost
  double lower_bound = 0;  // total / workers (a unit splits down to single keys)
  double total_cost = 0;
};

int64_t size_words(int64_t num_workers);

// Checks the configuration and arrays (ArgumentError naming the argument) and plans.
Plan make_plan(const Config& config, const Arrays& arrays);
void write(const Plan& plan, int32_t* out);

// Parses and checks the structure; ArgumentError("metadata") when the words are not a plan.
Plan read(const int32_t* words, int64_t size);

// A call's configuration and arrays, read off its params (num_workers unset).
Config config_of(const SparseFlashMlaParams& call, const MlaSequences& seqs);
Arrays arrays_of(const SparseFlashMlaParams& call);

// Checks that `planned` was made for this call: every argument and array (ArgumentError
// ("metadata") naming the first that differs) and that its stretches cover the call's rows.
void verify(const Plan& planned, const Config& call, const Arrays& arrays, int64_t rows);

// Each worker's stretch as work items of the call's sequences (one group per worker), with the
// split units' combines.
sparse::TokenSchedule schedule(const Plan& plan, const std::vector<Sequence>& seqs);

}  // namespace opmesh::core::mla_plan
