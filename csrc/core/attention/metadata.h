// The metadata tensor: a plan serialised into int32 words (docs/ops/flash_attn.md, "Metadata
// format"). Its length depends on num_workers only, so graph capture can size it without data.
//
//   [0, kHeaderWords)                     header (field indices below)
//   kWorkerWords words per worker         begin b,h,t,k | end b,h,t,k | begin_slot | end_slot |
//                                         cost (float32 bits)
//   kCombineWords words per worker        b, h, t, first_slot, num_slots (unused rows are zero)
// A backward plan (header field kFieldDirection = 1) uses the worker rows for its ranges:
// key_begin, key_end, query_begin, query_end, 0 x 6, cost; it has no combine tasks.
// Version 2 added the direction; plans of version 1 are refused.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config.h"
#include "flash_attn_backward.h"
#include "plan_words.h"
#include "planner.h"

namespace opmesh::core::attention::metadata {

inline constexpr int32_t kMagic = 0x414d4f46;  // "FOMA" read as little-endian bytes
inline constexpr int32_t kVersion = 2;

// The header's words after the four every plan starts with (plan_words.h).
enum Field : int {
  kFieldNumCombines = plan_words::kHeaderStart,
  kFieldNumSlots,
  kFieldGroup,
  kFieldPositions,
  kFieldRows,
  kFieldKeyTile,
  kFieldChunkTiles,
  kFieldDeterministic,
  kFieldNumHeadsQ,
  kFieldNumHeadsKv,
  kFieldHeadDim,
  kFieldHeadDimV,
  kFieldBatchSize,
  kFieldMaxSeqlenQ,
  kFieldMaxSeqlenKv,
  kFieldMaskMode,
  kFieldWinLeft,
  kFieldWinRight,
  kFieldLayoutQ,
  kFieldLayoutKv,
  kFieldLayoutOut,
  kFieldLengthHashes,  // 4 arrays x (present, hash low, hash high) = 12 words
  kFieldMakespan = kFieldLengthHashes + 12,
  kFieldLowerBound,
  kFieldTotalCost,
  kFieldNumTasks,
  kFieldNumSplits,
  kFieldDirection,  // 0: forward (flash_attn), 1: backward (flash_attn_backward)
  kFieldKeyUnits,   // backward plans: units of the key pass and of the query pass
  kFieldQueryUnits,
  kFieldFused,  // backward plans: 1 when the backward runs as one fused pass
  kHeaderWords
};
inline constexpr int64_t kWorkerWords = 11;
inline constexpr int64_t kCombineWords = 5;

// Names of the four length arrays, in header order.
inline constexpr const char* kLengthNames[4] = {"cu_seqlens_q", "cu_seqlens_kv", "seqused_q",
                                                "seqused_kv"};

int64_t size_words(int64_t num_workers);

// Plans the call and writes the metadata. `out` holds size_words(config.num_workers) words.
void write(const PlanConfig& config, const LengthArrays& lengths, int32_t* out);

// Whether a length array was given, and the 64-bit hash of its values.
using ArrayPrint = plan_words::ArrayPrint;

// A decoded metadata tensor.
struct Decoded {
  PlanConfig config;  // config.backward tells which of the two plans below is set
  Plan plan;
  BackwardPlan backward;
  ArrayPrint length_prints[4];
};

// Parses and checks the structure (magic, version, sizes, ranges); throws ArgumentError("metadata")
// when the words are not a metadata tensor of this version.
Decoded read(const int32_t* words, int64_t size);

// Checks that the metadata was planned for this call: every argument and the values of every
// length array. Throws ArgumentError naming the first argument that differs, with both values.
void verify(const Decoded& planned, const PlanConfig& call, const LengthArrays& lengths);

}  // namespace opmesh::core::attention::metadata
