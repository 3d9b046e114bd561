// What the sequence-based operators share below their params: the band mask of the indexer
// family's arguments, length arrays, the query and key layouts of the sparse stage (with paged
// keys) and its selections (sparse_indices).
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "vocabulary.h"

namespace opmesh::core {

// The mask sparse_mode, pre_tokens and next_tokens describe (kNone, kCausal or kWindow); throws
// ArgumentError naming the argument that is out of range.
Mask indexer_mask(MaskMode sparse_mode, int64_t pre_tokens, int64_t next_tokens);

// Checks a length array of `batch` entries against `total` tokens: cumulative ends (no leading
// 0, non-decreasing, last == total; required when batch > 0) or per-sequence lengths in
// [0, total] (nullptr allowed). Throws ArgumentError naming `name`.
void check_indexer_lengths(const int64_t* lens, int64_t batch, int64_t total, bool cumulative,
                           const char* name);

// Compressed keys (DeepSeek-V4's indexer): each key entry stands for cmp_ratio original tokens,
// and under the causal mask a query sees the entries whose last original token is at or before
// its bottom-right-aligned position (Mask::ratio); cmp_residuals [B] (nullptr: all 0) gives each
// sequence's original tokens past its last whole entry, each in [0, cmp_ratio).
struct Compression {
  int64_t cmp_ratio = 1;
  const int64_t* cmp_residuals = nullptr;
};

// cmp_ratio within [1, kMaxTokens]; residuals only with compression, each in [0, cmp_ratio); no
// band over compressed keys (a window in original tokens has no entry-wise meaning there).
// ArgumentError names cmp_ratio, cmp_residual_key, pre_tokens or next_tokens.
void validate(const Compression& compression, int64_t batch, int64_t pre_tokens,
              int64_t next_tokens);

// The mask with the compression's ratio, and the sequences with its residuals.
inline Mask compressed(Mask mask, const Compression& c) {
  mask.ratio = c.cmp_ratio;
  return mask;
}
inline void apply_residuals(const Compression& c, std::vector<Sequence>& seqs) {
  if (c.cmp_residuals == nullptr) return;
  for (Sequence& s : seqs) s.residual = c.cmp_residuals[s.batch];
}

// Paged keys: block_table [B][max_blocks] (row-major), entries in [0, block_count) for every
// block a sequence's length reaches; block_size keys a block.
struct PagedKeys {
  const int64_t* block_table = nullptr;
  int64_t max_blocks = 0;
  int64_t block_size = 0;
  int64_t block_count = 0;
};

// What the sparse stage's operators (lightning_indexer, sparse_flash_attention) share, the base of
// their params: queries BSND (per-sequence lengths, or all seq_q) or TND (cumulative ends); keys
// in the queries' layout, or paged (kPagedBBND: per-sequence lengths and a block table of
// max_blocks entries per sequence), their layout given apart (the operators name it differently);
// the indexer family's band mask, bottom-right aligned per sequence; the heads.
struct QueryKeyLayout : PagedKeys {
  Layout layout_query = Layout::kBSND;  // BSND or TND
  MaskMode sparse_mode = MaskMode::kCausal;
  int64_t pre_tokens = std::numeric_limits<int64_t>::max();
  int64_t next_tokens = std::numeric_limits<int64_t>::max();

  int64_t batch = 0;     // B; for TND queries the number of sequences
  int64_t seq_q = 0;     // BSND: S1; TND: T1
  int64_t seq_k = 0;     // BSND: S2; TND: T2; paged: unused
  int64_t heads_q = 0;   // N1, a multiple of N2
  int64_t heads_k = 0;   // N2
  int64_t head_dim = 0;  // D of query and key

  // Query lengths: BSND per-sequence lengths [B] in [0, S1] (nullptr: all S1); TND cumulative
  // ends [B] (no leading 0, non-decreasing, last == T1), required.
  const int64_t* seq_q_lens = nullptr;
  // Key lengths: BSND per-sequence [B] in [0, S2] (nullptr: all S2); TND cumulative ends [B]
  // (last == T2), required; paged per-sequence [B], required, each within the block table.
  const int64_t* seq_k_lens = nullptr;

  // Paged keys: the PagedKeys base.
};

// Checks the layouts, sizes, lengths, block table and band with keys in layout `key`; messages
// name the arguments (`key_layout`, `q_lens_name`, `k_lens_name`, "block_table", the band's).
void validate(const QueryKeyLayout& layout, Layout key, const char* key_layout,
              const char* q_lens_name, const char* k_lens_name);

// The N1 query heads over N2 key heads of a grouped call: N1 in [1, kMaxHeads], N2 dividing it;
// ArgumentError naming "query" or "key".
void check_grouped_heads(int64_t heads_q, int64_t heads_k);

// The sequences of a validated layout (paged keys start at 0).
std::vector<Sequence> query_key_sequences(const QueryKeyLayout& layout, Layout key);

// A sparse_indices tensor: [B, S1, heads, count] (strides {b, s, n, k}) or, for TND queries,
// [T1, heads, count] (strides {unused, t, n, k}); each entry -1 or a block of `block_size` keys.
struct Selection {
  View indices;  // int32
  int64_t heads = 1;
  int64_t count = 0;
  int64_t block_size = 1;
  bool tnd = false;
  const char* name = "sparse_indices";
  // How many leading entries of each row count: int32 [B, S1, heads] / [T1, heads] (sd unused),
  // each in [0, count]; data nullptr: all `count`.
  View lengths;
  const char* lengths_name = "";

  // Entries of row (s, i, n) that count.
  int64_t row_count(const Sequence& s, int64_t i, int64_t n) const {
    if (lengths.data == nullptr) return count;
    const int64_t at =
        (tnd ? 0 : s.batch * lengths.sb) + (s.q_begin + i) * lengths.ss + n * lengths.sn;
    return static_cast<const int32_t*>(lengths.data)[at];
  }
};

// Checks a selection's values, O(count) per row: every counted entry is -1 or a block of its
// sequence's keys, and no row names a block twice; the row lengths in [0, count]. Throws
// ArgumentError naming the selection (or its lengths), the row and entry.
void validate(const Selection& selection, const std::vector<Sequence>& seqs);

}  // namespace opmesh::core
