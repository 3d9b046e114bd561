// What the sequence-based operators share below their params: the band mask of the indexer
// family's arguments, length arrays, the query and key layouts of the sparse stage (with paged
// keys) and its selections (sparse_indices).
#pragma once

#include <cstdint>
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

// The sparse stage's operators (lightning_indexer, sparse_flash_attention) read queries and keys
// in layouts of their own: queries BSND (per-sequence lengths, or all seq_q) or TND (cumulative
// ends); keys the queries' layout, or paged (kPagedBBND, per-sequence lengths and a block table
// of max_blocks entries per sequence).
struct QueryKeyLayout {
  Layout query = Layout::kBSND;
  Layout key = Layout::kBSND;
  int64_t batch = 0;
  int64_t seq_q = 0;  // S1 or T1
  int64_t seq_k = 0;  // S2 or T2; paged: unused
  const int64_t* q_lens = nullptr;
  const int64_t* k_lens = nullptr;
  const int64_t* block_table = nullptr;
  int64_t max_blocks = 0;
  int64_t block_size = 0;
  int64_t block_count = 0;
};

// Checks the layouts, sizes, lengths and block table; messages name the arguments
// (`key_layout`, `q_lens_name`, `k_lens_name`, "block_table").
void validate(const QueryKeyLayout& layout, const char* key_layout, const char* q_lens_name,
              const char* k_lens_name);

// The layout of an operator's params (their query/key fields share these names; the key layout
// is given apart since the operators name it differently).
template <class Params>
QueryKeyLayout query_key_layout_of(const Params& p, Layout key) {
  QueryKeyLayout l;
  l.query = p.layout_query;
  l.key = key;
  l.batch = p.batch;
  l.seq_q = p.seq_q;
  l.seq_k = p.seq_k;
  l.q_lens = p.seq_q_lens;
  l.k_lens = p.seq_k_lens;
  l.block_table = p.block_table;
  l.max_blocks = p.max_blocks;
  l.block_size = p.block_size;
  l.block_count = p.block_count;
  return l;
}

// The sequences of a validated layout (paged keys start at 0).
std::vector<Sequence> query_key_sequences(const QueryKeyLayout& layout);

// A sparse_indices tensor: [B, S1, heads, count] (strides {b, s, n, k}) or, for TND queries,
// [T1, heads, count] (strides {unused, t, n, k}); each entry -1 or a block of `block_size` keys.
struct Selection {
  const int32_t* indices = nullptr;
  const int64_t* stride = nullptr;
  int64_t heads = 1;
  int64_t count = 0;
  int64_t block_size = 1;
  bool tnd = false;
};

// Checks sparse_indices' values, O(count) per row: every entry is -1 or a block of its
// sequence's keys, and no row names a block twice. Throws ArgumentError("sparse_indices") naming
// the row and entry.
void validate(const Selection& selection, const std::vector<Sequence>& seqs);

}  // namespace opmesh::core
