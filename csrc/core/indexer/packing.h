// Packing of the lightning indexer's operands into a kernel set's words, shared by the indexer's
// kernels (its softmax statistics and its top-k): one key head's group of query rows with their
// weights, and key tiles transposed to [depth][kKeyTile]. Keys are read contiguous per sequence
// (BSND, TND) or through a block table (paged).
#pragma once

#include <cstdint>

#include "../dtype.h"
#include "../kernels/kernel_set.h"
#include "../vocabulary.h"

namespace opmesh::core::indexer {

struct Operands {
  DType qk_dtype = DType::kFloat32;       // query and key
  DType weights_dtype = DType::kFloat32;  // qk_dtype or float32
  const void* query = nullptr;            // [B,S1,N1,D] or [T1,N1,D]
  const void* key = nullptr;              // [B,S2,N2,D], [T2,N2,D] or [blocks,block_size,N2,D]
  const void* weights = nullptr;          // [B,S1,N1] or [T1,N1]
  // Element strides {b, s, n, d} ({unused, t, n, d} for TND; {block, slot, n, d} when paged).
  int64_t query_stride[4] = {0, 0, 0, 0};
  int64_t key_stride[4] = {0, 0, 0, 0};
  int64_t weights_stride[3] = {0, 0, 0};
  bool batched_query = true;  // BSND: a sequence's rows start at batch * stride[0]
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

class Packer {
 public:
  Packer(const Operands& ops, const kernels::KernelSet& set);

  int64_t words() const { return words_; }  // packed words per row
  int64_t depth() const { return depth_; }  // words_ padded to the set's depth_align

  // Words of scratch pack_keys needs for `row` and `stage`.
  int64_t row_words() const { return 2 * words_; }
  int64_t stage_words() const { return kernels::kKeyTile * words_; }

  // Query rows [p0, p0 + rows) of every query head of key head g into
  // query[h][r][depth] (row_capacity rows per head), their weights into weights[r][groups].
  void pack_queries(const Sequence& seq, int64_t p0, int rows, int64_t g, int64_t row_capacity,
                    uint32_t* query, float* weights) const;

  // Keys [j0, j0 + count) of key head g transposed into dst[depth][kKeyTile], the rest zero.
  void pack_keys(const Sequence& seq, int64_t g, int64_t j0, int64_t count, uint32_t* dst,
                 float* stage, uint32_t* row) const;

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
