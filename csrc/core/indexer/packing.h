// Packing of the lightning indexer's operands into a kernel set's words, shared by the indexer's
// kernels (its softmax statistics and its top-k): one key head's group of query rows with their
// weights, and key tiles transposed to [depth][kKeyTile]. Keys are read contiguous per sequence
// (BSND, TND) or through a block table (paged).
#pragma once

#include <algorithm>
#include <cstdint>

#include "../dtype.h"
#include "../kernels/kernel_set.h"
#include "../vocabulary.h"

namespace opmesh::core::indexer {

struct Operands {
  DType qk_dtype = DType::kFloat32;       // query and key
  DType weights_dtype = DType::kFloat32;  // qk_dtype or float32
  View query;                             // [B,S1,N1,D] or [T1,N1,D]
  View key;                               // [B,S2,N2,D], [T2,N2,D] or [blocks,block_size,N2,D]
  View weights;                           // [B,S1,N1] or [T1,N1] (sd unused)
  bool batched_query = true;              // BSND: a sequence's rows start at batch * stride[0]
  bool batched_key = true;
  int64_t heads_q = 0;  // N1
  int64_t heads_k = 0;  // N2
  int64_t head_dim = 0;
  // Paged keys (when block_table is set): key j of sequence b is slot j % block_size of block
  // block_table[b * block_table_stride + j / block_size].
  const int64_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int64_t block_size = 0;
};

// The operands of an indexer call's params (IndexerParams, LightningIndexerParams: the same
// input fields), with each side's batching given by its layout.
template <class Params>
Operands operands_of(const Params& p, bool batched_query, bool batched_key) {
  return Operands{
      p.qk_dtype, p.weights_dtype, p.query, p.key, p.weights, batched_query, batched_key, p.heads_q,
      p.heads_k,  p.head_dim,      nullptr, 0,     0};
}

// The rows [begin, end) of a unit that see key tile [j0, j0 + kKeyTile): its rows are ordered
// by visible range (both ends non-decreasing, empty rows first), so the prefix that sees none of
// the tile and the suffix whose range starts after it are left out. `begin` only grows from one
// tile to the next; returns `end`.
inline int rows_seeing_tile(const KeyRange* keys, int rows, int64_t j0, int& begin) {
  while (begin < rows && keys[begin].end <= j0) ++begin;
  int end = rows;
  while (end > begin && keys[end - 1].begin >= j0 + kernels::kKeyTile) --end;
  return end;
}

class Packer {
 public:
  Packer(const Operands& ops, const kernels::KernelSet& set);

  int64_t words() const { return words_; }  // packed words per row
  int64_t depth() const { return depth_; }  // words_ padded to the set's depth_align

  // Words of scratch pack_keys needs for `row`.
  int64_t row_words() const { return 2 * words_; }

  // Query rows [p0, p0 + rows) of every query head of key head g into
  // query[h][r][depth] (row_capacity rows per head), their weights into weights[r][groups].
  void pack_queries(const Sequence& seq, int64_t p0, int rows, int64_t g, int64_t row_capacity,
                    uint32_t* query, float* weights) const;

  // Keys [j0, j0 + count) of key head g transposed into dst[depth][kKeyTile], the rest zero.
  void pack_keys(const Sequence& seq, int64_t g, int64_t j0, int64_t count, uint32_t* dst,
                 uint32_t* row) const;

  // The scores of key tile [j0, j0 + kKeyTile) of key head g for rows [begin, end) of a unit
  // whose queries sc.query.data holds (row_capacity rows per head): the tile's keys packed into
  // sc.key.data, then the set's score tile into sc.scores ([rows][kKeyTile], those rows zeroed
  // first).
  template <class Scratch>
  void score_rows(Scratch& sc, const Sequence& seq, int64_t g, int64_t j0, int64_t row_capacity,
                  int begin, int end) const {
    pack_keys(seq, g, j0, std::min<int64_t>(kernels::kKeyTile, seq.k_len - j0), sc.key.data(),
              reinterpret_cast<uint32_t*>(sc.row.data()));
    std::fill(sc.scores.data() + begin * kernels::kKeyTile,
              sc.scores.data() + end * kernels::kKeyTile, 0.0f);
    set_.score_tile({sc.query.data(), row_capacity, sc.key.data(), sc.weights.data(),
                     sc.scores.data(), begin, end, static_cast<int>(groups_), depth_});
  }

 private:
  int64_t key_offset(const Sequence& seq, int64_t g, int64_t j) const;

  const Operands& o_;
  const kernels::KernelSet& set_;
  int64_t groups_;
  bool bf16_pairs_;
  int64_t words_;
  int64_t depth_;
  int64_t elem_;  // bytes per query/key element
};

}  // namespace opmesh::core::indexer
