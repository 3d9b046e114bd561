// DeepSeek-V4's compressor: every cmp_ratio original tokens of a sequence become one compressed
// key/value entry, a per-channel softmax-weighted sum of the tokens' projections.
//
// For token p (absolute position start_pos + i of its sequence) with hidden state x_p:
//   kv_p    = wkv x_p              [coff * D]
//   score_p = wgate x_p + ape[p mod r]   [coff * D]
// Entry w (r = cmp_ratio) is emitted by the call that holds its last token (w + 1) r - 1:
//   coff = 1: slots are the tokens of window w, [w r, (w + 1) r), channels [0, D);
//   coff = 2: also window w - 1's tokens (when w >= 1) on channels [0, D), window w's on
//             channels [D, 2 D): two overlapping series, each entry spanning 2 r tokens;
//   cmp_kv[w][c] = sum_j softmax_j(score_j[c]) kv_j[c] over the entry's slots j.
// Tokens before start_pos come from the state cache, which holds [kv_p | score_p] (float32,
// 2 coff D values) per position; the call stores its own tokens there, so decoding one token at
// a time emits an entry every r tokens.
#pragma once

#include <cstdint>
#include <vector>

#include "../cpu_features.h"
#include "../dtype.h"
#include "../executor.h"
#include "../vocabulary.h"

namespace opmesh::core {

// One sequence of a compressor call.
struct CompressorSequence {
  int64_t batch = 0;        // its row of the batch (x's batch, state_block_table's row)
  int64_t x_begin = 0;      // its first token row of x ([T, H]: cu_seqlens[b]; [B, S, H]: 0)
  int64_t tokens = 0;       // tokens it compresses (seqused[b])
  int64_t start = 0;        // absolute position of its first token (start_pos[b])
  int64_t out_begin = 0;    // its first row of cmp_kv ([T, D]: after the earlier sequences')
  int64_t first_entry = 0;  // the first entry it emits, start / r
  int64_t entries = 0;      // entries it emits: (start + tokens) / r - start / r
};

struct CompressorParams {
  int64_t batch = 0;
  int64_t seq_len = 0;  // S of x [B, S, H]; 0 for [T, H]
  int64_t tokens = 0;   // T of x [T, H] (or B * S)
  bool packed = false;  // x is [T, H] with cu_seqlens
  int64_t hidden = 0;   // H
  int64_t dim = 0;      // D
  int64_t coff = 1;     // 1, or 2: two overlapping series
  int64_t cmp_ratio = 0;
  int64_t cache_mode = 1;             // 1: state_block_table [B, blocks] by position; 2: a ring [B]
  DType dtype = DType::kFloat32;      // x, wkv, wgate and cmp_kv
  DType ape_dtype = DType::kFloat32;  // ape
  View x;                             // [batch][token][-][hidden]: sb (0 packed), ss, sd
  View wkv, wgate;                    // [coff D][H]: ss per row, sd per element
  View ape;                           // [r][coff D]: ss, sd
  MutableView cmp_kv;                 // [batch][entry][-][D]: sb (0 packed), ss, sd
  int64_t out_rows = 0;               // entries cmp_kv holds (per batch, or in all packed)
  // The state cache, float32 [num_blocks][block_size][-][2 coff D] (sd 1), when has_state.
  bool has_state = false;
  MutableView state;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  const int64_t* block_table = nullptr;  // [batch][table_width]; 0 = no block (null: batch 0)
  int64_t table_width = 0;
  // Every token's projected row [kv | score] (float32, 2 coff D values, ape included: the state
  // cache's rows), when has_projections: the forward writes the rows of the tokens it uses, and
  // the backward reads them instead of computing them again.
  bool has_projections = false;
  MutableView projections;  // [batch][token][-][2 coff D]: sb (0 packed), ss, sd 1
  // Host lengths, each null when absent: cu_seqlens [batch + 1], seqused and start_pos [batch].
  const int64_t* cu_seqlens = nullptr;
  const int64_t* seqused = nullptr;
  const int64_t* start_pos = nullptr;
};

// The gradients of compressor_backward (the forward's params give the inputs, cmp_kv unused).
struct CompressorGrads {
  View d_cmp_kv;             // like cmp_kv, in the params' dtype
  MutableView dx;            // like x
  MutableView dwkv, dwgate;  // like wkv, wgate
  MutableView dape;          // like ape, in ape_dtype
};

// Checks sizes, options, lengths and the state cache's table for every position the call reads
// or writes, throwing ArgumentError naming the argument, and returns the sequences.
std::vector<CompressorSequence> validate(const CompressorParams& params);

// Positions [lo, start) of a sequence the call reads from the state cache (lo == start: none).
int64_t first_state_position(const CompressorParams& params, const CompressorSequence& seq);

// validate; cmp_kv (padding rows zero); then the call's tokens into the state cache (and their
// projections, when given).
void compressor(const CompressorParams& params, const Executor& executor, Isa isa);

// validate; the gradients of cmp_kv with respect to x, wkv, wgate and ape, from the forward's
// projections when given. A call whose entries read earlier tokens from the state cache is
// refused (start_pos): those tokens are constants the forward found in the cache.
void compressor_backward(const CompressorParams& params, const CompressorGrads& grads,
                         const Executor& executor, Isa isa);

}  // namespace opmesh::core
