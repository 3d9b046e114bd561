// Micro-kernel interface of the indexer: one packed key tile against the packed query rows of a
// task. Each instruction set implements it in its own translation unit (isa/*.cpp), compiled with
// that set's flags and chosen at run time.
#pragma once

#include <cstdint>

#include "cpu_features.h"

namespace opmesh::core::indexer {

// Packed operands hold 4-byte words: a float per element (float path) or a pair of bf16
// elements of consecutive d (bf16 path, the layout the AVX-512 BF16 dot product consumes).
struct ScoreTileArgs {
  const void* query;     // [groups][row_capacity][depth] words; row r of head h at
                         //   query + (h * row_capacity + r) * depth
  int64_t row_capacity;  // rows allocated per head in `query`
  const void* key;       // [depth][kKeyTile] words, keys past the sequence end zero-filled
  const float* weights;  // [rows][groups]
  float* scores;         // [rows][kKeyTile], accumulated into:
                         //   scores[r][j] += sum_h weights[r][h] * relu(dot(q[h][r], k[:, j]))
  int row_begin;         // rows [row_begin, row_end) are computed; others are left alone
  int row_end;
  int groups;     // query heads per key head
  int64_t depth;  // words per row: D (float) or ceil(D / 2) (bf16 pairs)
};

using ScoreTileFn = void (*)(const ScoreTileArgs&);

// nullptr when that combination is not built (e.g. bf16 pairs below avx512_bf16).
ScoreTileFn score_tile_fn(Isa isa, bool bf16_pairs);

void score_tile_scalar_f32(const ScoreTileArgs& args);
#if defined(__x86_64__)
void score_tile_avx2_f32(const ScoreTileArgs& args);
void score_tile_avx512_f32(const ScoreTileArgs& args);
void score_tile_avx512_bf16(const ScoreTileArgs& args);
#endif

}  // namespace opmesh::core::indexer
