// sparse_flash_attention: attention of each query token over the keys its sparse_indices select
// (blocks of sparse_block_size keys, intersected with the mask), forward and backward:
//   s[t, h, j] = scale * (q[t, h] . k[j, g] + q_rope[t, h] . k_rope[j, g]),  g = h / (N1 / N2)
//   (with softcap > 0: s <- softcap tanh(s / softcap))
//   out[t, h]  = sum_j p[t, h, j] v[j, g],  p = softmax over the selected j (and the sink)
// Work and memory: O(tile) per worker, no S1 x S2 buffer; the results, gradients included, are
// the same bits for any executor.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "../cpu_features.h"
#include "../dtype.h"
#include "../executor.h"
#include "../selection.h"
#include "../vocabulary.h"

namespace opmesh::core {

// The queries' layout, band, sizes, heads, lengths and block table are QueryKeyLayout's
// (selection.h); the keys' layout is layout_kv.
struct SparseAttentionParams : QueryKeyLayout {
  Layout layout_kv = Layout::kBSND;  // layout_query's, or kPagedBBND (the public PA_BSND)

  int64_t rope_dim = 0;      // Dr of query_rope and key_rope (0: none)
  int64_t value_dim = 0;     // Dv of value and the output
  int64_t index_heads = 1;   // the key-head dim of sparse_indices: N2, or 1 (one selection for all)
  int64_t sparse_count = 0;  // K, entries per selection row
  int64_t sparse_block_size = 1;
  float scale = 1.0f;
  // Logit soft-capping: s <- softcap tanh(s / softcap) on the scaled scores (0: none).
  float softcap = 0.0f;

  DType dtype = DType::kFloat32;  // query, key, value, the ropes and the output
  // Views (vocabulary.h; TND: sb unused; paged keys {block, slot, n, d}).
  View query;
  View key;
  View value;
  View query_rope;  // [.., N1, Dr] in query's layout, or data nullptr (Dr = 0)
  View key_rope;    // [.., N2, Dr] in key's layout
  // sparse_indices [B, S1, index_heads, K] / [T1, index_heads, K], int32, sd along K.
  View indices;
  const float* sinks = nullptr;  // [N1] or nullptr
  // A quantized key and value (one byte per element of kv_format, key_rope in dtype): row (s, j,
  // g) reads as its elements times the float32 scale at the same (b or block, s or slot, head)
  // of key_scale / value_scale (strides sb, ss, sn), dequantized as the row is gathered (rounded
  // to bf16 on the bf16-pair kernels). Forward only.
  CacheFormat kv_format = CacheFormat::kPlain;
  View key_scale, value_scale;

  // Forward outputs: out in query's layout with Dv (dtype); the statistics float32 contiguous
  // [B, N2, S1, G] / [N2, T1, G] (G = N1 / N2), or nullptr.
  MutableView out;
  float* softmax_max = nullptr;
  float* softmax_sum = nullptr;
  // The log-sum-exp, sink included, in the statistics' layout (-inf for a row with neither a
  // key nor a sink), or nullptr.
  float* softmax_lse = nullptr;
};

// The backward's extra inputs and its outputs. Gradients are written contiguous in their
// input's shape and dtype (dsinks float32 [N1]); rows no token reaches get zeros.
struct SparseAttentionGrads {
  View dout;  // out's shape, layout and dtype
  View out;
  const float* softmax_max = nullptr;  // the forward's statistics, contiguous
  const float* softmax_sum = nullptr;
  const float* softmax_lse = nullptr;  // or its log-sum-exp (sink included) in their place
  const float* dlse = nullptr;         // the log-sum-exp's gradient (same layout), or nullptr
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  void* dq_rope = nullptr;  // when rope_dim > 0
  void* dk_rope = nullptr;
  float* dsinks = nullptr;  // when sinks
};

// Throws ArgumentError naming the first argument that is wrong, sparse_indices' values included
// (an entry below -1, past its sequence's blocks, or repeated in one row).
void validate(const SparseAttentionParams& params);

std::vector<Sequence> sparse_attention_sequences(const SparseAttentionParams& params);

// Validates, then writes out and (when given) the statistics. A row that selects no key gets a
// zero output and statistics (-inf, 0).
void sparse_flash_attention(const SparseAttentionParams& params, const Executor& executor, Isa isa);

// Validates, then writes the gradients (paged keys have none: kPagedBBND is refused).
void sparse_flash_attention_backward(const SparseAttentionParams& params,
                                     const SparseAttentionGrads& grads, const Executor& executor,
                                     Isa isa);

}  // namespace opmesh::core
