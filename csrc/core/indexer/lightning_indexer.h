// lightning_indexer: for every query token and key head, the positions of the sparse_count keys
// with the highest lightning-indexer score
//   I[t, s] = sum over the query heads h of key head g: weights[t, h] * relu(query[t, h] . key[s,
//   g])
// among the keys the token sees, streamed over key tiles: no S1 x S2 score matrix, extra memory
// O(tile + rows x sparse_count) per worker.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "../cpu_features.h"
#include "../dtype.h"
#include "../executor.h"
#include "../vocabulary.h"
#include "indexer.h"

namespace opmesh::core {

// sparse_count's range.
inline constexpr int64_t kMaxSparseCount = int64_t{1} << 16;

// The queries' layout, band, sizes, heads, lengths and block table are QueryKeyLayout's
// (selection.h); the keys' layout is layout_key: BSND or TND (as layout_query), or kPagedBBND
// (the public PA_BSND): key [block_count, block_size, N2, D] read through block_table.
struct LightningIndexerParams : QueryKeyLayout, Compression {  // compressed keys: Compression
  Layout layout_key = Layout::kBSND;
  int64_t sparse_count = 0;  // K, in [1, kMaxSparseCount]
  // The selection ranks the scores I; `values` holds scale_value * I (finite, > 0).
  float scale_value = 1.0f;

  DType qk_dtype = DType::kFloat32;
  DType weights_dtype = DType::kFloat32;  // qk_dtype or float32
  View query;                             // BSND [B,S1,N1,D]  TND [T1,N1,D]
  View key;                               // BSND [B,S2,N2,D]  TND [T2,N2,D]  paged [blocks,bs,N2,D]
  View weights;                           // BSND [B,S1,N1]    TND [T1,N1] (sd unused)

  // Outputs, contiguous: indices int32 [rows][N2][K] (rows = B*S1 or T1), positions within the
  // row's sequence in descending score, ties to the lower position, -1 past the visible keys;
  // values float32 alongside (-inf past the visible keys), or nullptr.
  int32_t* indices = nullptr;
  float* values = nullptr;

  int bf16_pairs = -1;  // as IndexerParams::bf16_pairs
};

// Throws ArgumentError naming the first argument that is wrong (values of the length arrays and
// the block table included).
void validate(const LightningIndexerParams& params);

// The sequences of a validated call (key positions within each sequence; paged keys have
// k_begin 0).
std::vector<Sequence> lightning_indexer_sequences(const LightningIndexerParams& params);

// Validates, then writes the outputs. The result is the same bits for any executor.
void lightning_indexer(const LightningIndexerParams& params, const Executor& executor, Isa isa);

}  // namespace opmesh::core
