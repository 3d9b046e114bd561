// What a flash-attention call is planned for: the non-tensor arguments, the sequence-length
// arrays, and the per-sequence lengths resolved from them. Shared by the planner, the metadata
// format and the kernel, so all three agree on which query sees which key.
#pragma once

#include <cstdint>
#include <vector>

#include "../kernels/kernel_set.h"
#include "../vocabulary.h"

namespace opmesh::core::attention {

using core::KeyRange;
using core::kMaxBatch;
using core::kMaxHeadDim;
using core::kMaxHeads;
using core::kMaxTokens;
using core::Layout;
using core::layout_name;
using core::Mask;
using core::MaskMode;
using core::normalize_window;
using core::Sequence;
using kernels::kKeyTile;

// Every argument of flash_attn_metadata except the length arrays.
struct PlanConfig {
  int64_t num_heads_q = 0;
  int64_t num_heads_kv = 0;
  int64_t head_dim = 0;
  int64_t head_dim_v = 0;
  int64_t batch_size = 0;
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_kv = 0;
  MaskMode mask_mode = MaskMode::kNone;
  int64_t win_left = -1;  // -1: unbounded
  int64_t win_right = -1;
  Layout layout_q = Layout::kBSND;
  Layout layout_kv = Layout::kBSND;
  Layout layout_out = Layout::kBSND;
  int64_t num_workers = 1;
  bool deterministic = false;
  // A plan for flash_attn_backward rather than for the forward (metadata only).
  bool backward = false;
  // The keys' compression (the indexer over compressed keys; Mask::ratio): 1 for flash attention.
  // Not part of the metadata format.
  int64_t cmp_ratio = 1;
  // Query positions per tile; 0 chooses kTargetRows / group (flash attention). Not part of the
  // metadata format: a plan decoded from metadata always has 0 here.
  int64_t tile_positions = 0;
};

// Optional int32 arrays (nullptr when absent): cu_seqlens_* hold batch_size + 1 entries,
// seqused_* hold batch_size.
struct LengthArrays {
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_kv = nullptr;
  const int32_t* seqused_q = nullptr;
  const int32_t* seqused_kv = nullptr;
};

// Checks the configuration (head counts, dims, mask/window combination, layouts) and throws
// ArgumentError naming the first offending argument.
void validate_config(const PlanConfig& config);

// The sequences of the batch after applying cu_seqlens and seqused (the shorter wins).
// Resolves and validates the lengths: cu_seqlens must start at 0 and be non-decreasing, no length
// may exceed max_seqlen_*, seqused_* must be in [0, max]. Throws ArgumentError naming the array.
std::vector<Sequence> resolve_sequences(const PlanConfig& config, const LengthArrays& lengths);

// The mask a configuration describes, and the keys it lets query row `i` of a sequence see.
inline Mask mask_of(const PlanConfig& c) {
  return {c.mask_mode, c.win_left, c.win_right, c.cmp_ratio};
}
inline KeyRange visible_keys(const PlanConfig& config, const Sequence& seq, int64_t i) {
  return core::visible_keys(mask_of(config), seq, i);
}

// Tile geometry. A query tile holds `positions` consecutive query positions of one sequence times
// all `group` query heads that share a key head, so one packed key/value tile serves every row.
// 128 rows: twice the rows per packed tile of 64, and 16 tokens of 8 query heads per key head
// (speculative decoding) make one tile instead of two that would each pack every key tile
// (measured on AMX: S_q = 16 decode 1.2-1.5x faster, prefill a few percent; level on the
// float32 and VDPBF16PS kernels).
inline constexpr int64_t kTargetRows = 128;

struct Geometry {
  int64_t group = 1;      // query heads per key head
  int64_t positions = 1;  // query positions per tile
  int64_t rows = 1;       // positions * group
};
Geometry geometry(const PlanConfig& config);

// The key tiles a query tile [p0, p1) touches, and the sub-range every row sees entirely (tiles
// outside it need per-row masking). All in absolute key-tile indices; empty when begin == end.
struct TileSpan {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t full_begin = 0;
  int64_t full_end = 0;
  int64_t masked_tiles() const { return (end - begin) - (full_end - full_begin); }
};
TileSpan tile_span(const PlanConfig& config, const Sequence& seq, int64_t p0, int64_t p1);

}  // namespace opmesh::core::attention
