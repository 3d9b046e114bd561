#include "packing.h"

#include <algorithm>

#include "../kernels/row_loads.h"

namespace opmesh::core::indexer {

using kernels::kKeyTile;

Packer::Packer(const Operands& ops, const kernels::KernelSet& set)
    : o_(ops),
      set_(set),
      groups_(ops.heads_q / ops.heads_k),
      bf16_pairs_(set.word == kernels::Word::kBf16Pair),
      words_(bf16_pairs_ ? (ops.head_dim + 1) / 2 : ops.head_dim),
      depth_(kernels::round_up(words_, set.depth_align)),
      elem_(dtype_size(ops.qk_dtype)) {}

void Packer::pack_queries(const Sequence& seq, int64_t p0, int rows, int64_t g,
                          int64_t row_capacity, uint32_t* query, float* weights) const {
  const View& qs = o_.query;
  const View& ws = o_.weights;
  const int64_t q_base = o_.batched_query ? seq.batch * qs.sb : 0;
  const int64_t w_base = o_.batched_query ? seq.batch * ws.sb : 0;
  for (int64_t h = 0; h < groups_; ++h) {
    const int64_t head = g * groups_ + h;
    for (int r = 0; r < rows; ++r) {
      const int64_t token = seq.q_begin + p0 + r;
      const int64_t offset = q_base + token * qs.ss + head * qs.sn;
      uint32_t* dst = query + (h * row_capacity + r) * depth_;
      if (bf16_pairs_) {
        load_row_bf16_pairs(o_.query.data, offset, qs.sd, o_.head_dim, dst);
      } else if (qs.sd == 1) {
        set_.widen(static_cast<const char*>(o_.query.data) + offset * elem_, o_.qk_dtype,
                   o_.head_dim, reinterpret_cast<float*>(dst));
      } else {
        load_row(o_.query.data, o_.qk_dtype, offset, qs.sd, o_.head_dim,
                 reinterpret_cast<float*>(dst));
      }
      std::fill(dst + words_, dst + depth_, 0u);
      load_row(o_.weights.data, o_.weights_dtype, w_base + token * ws.ss + head * ws.sn, 1, 1,
               weights + r * groups_ + h);
    }
  }
}

int64_t Packer::key_offset(const Sequence& seq, int64_t g, int64_t j) const {
  const View& ks = o_.key;
  if (o_.block_table != nullptr) {
    const int64_t block = o_.block_table[seq.batch * o_.block_table_stride + j / o_.block_size];
    return block * ks.sb + (j % o_.block_size) * ks.ss + g * ks.sn;
  }
  const int64_t base = o_.batched_key ? seq.batch * ks.sb : 0;
  return base + (seq.k_begin + j) * ks.ss + g * ks.sn;
}

// Contiguous rows go through the kernel set's transpose: as they are when already in the word
// type (float32, or bf16 pairs of an even D), else widened first.
void Packer::pack_keys(const Sequence& seq, int64_t g, int64_t j0, int64_t count, uint32_t* dst,
                       uint32_t* row) const {
  const View& ks = o_.key;
  if (ks.sd == 1 && (!bf16_pairs_ || o_.head_dim % 2 == 0)) {
    const bool direct = bf16_pairs_ || o_.qk_dtype == DType::kFloat32;
    const char* rows[kKeyTile];
    key_row_addresses(
        j0, count, o_.block_table != nullptr ? o_.block_size : 0, ks.ss * elem_,
        [&](int64_t key) {
          return static_cast<const char*>(o_.key.data) + key_offset(seq, g, key) * elem_;
        },
        rows);
    if (direct) {
      set_.pack_keys(rows, count, words_, dst);
    } else {
      set_.pack_widened_keys(rows, count, o_.qk_dtype, o_.head_dim, {}, dst);
    }
    std::fill(dst + words_ * kKeyTile, dst + depth_ * kKeyTile, 0u);
    return;
  }
  if (count < kKeyTile) std::fill(dst, dst + depth_ * kKeyTile, 0u);
  for (int64_t j = 0; j < count; ++j) {
    const int64_t offset = key_offset(seq, g, j0 + j);
    if (bf16_pairs_) {
      load_row_bf16_pairs(o_.key.data, offset, ks.sd, o_.head_dim, row);
    } else {
      load_row(o_.key.data, o_.qk_dtype, offset, ks.sd, o_.head_dim, reinterpret_cast<float*>(row));
    }
    for (int64_t l = 0; l < words_; ++l) dst[l * kKeyTile + j] = row[l];
  }
  if (count == kKeyTile) std::fill(dst + words_ * kKeyTile, dst + depth_ * kKeyTile, 0u);
}

}  // namespace opmesh::core::indexer
