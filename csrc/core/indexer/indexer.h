// dense_lightning_indexer_softmax_lse: softmax statistics of the lightning-indexer score
//   I[g,i,j] = sum_{h in group g} w[i,h] * relu(dot(q[i,h,:], k[j,g,:]))
// over the keys j visible to query i, without materialising I.
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

struct IndexerParams : Compression {  // compressed keys: Compression (selection.h)
  Layout layout = Layout::kBSND;      // BSND or TND
  // The operator's sparse_mode: kNone, or kCausal (key j visible to query i iff
  // j <= i + s2 - s1, aligned to the bottom-right corner of each sequence).
  MaskMode sparse_mode = MaskMode::kCausal;
  // A band around that diagonal (Ascend's convention): key j is visible to query i only if
  // d - pre_tokens <= j <= d + next_tokens, d = i + s2 - s1. Both >= 0; kMaxTokens or more is
  // unbounded (the defaults). With sparse_mode kCausal, next_tokens cannot widen the mask.
  int64_t pre_tokens = std::numeric_limits<int64_t>::max();
  int64_t next_tokens = std::numeric_limits<int64_t>::max();

  int64_t batch = 0;     // B; for TND the number of sequences (length of the seqlen arrays)
  int64_t seq_q = 0;     // BSND: S1; TND: T1 (total query tokens)
  int64_t seq_k = 0;     // BSND: S2; TND: T2
  int64_t heads_q = 0;   // N1
  int64_t heads_k = 0;   // N2, N1 % N2 == 0; query head h belongs to key head h / (N1 / N2)
  int64_t head_dim = 0;  // D

  DType qk_dtype = DType::kFloat32;       // dtype of query and key
  DType weights_dtype = DType::kFloat32;  // qk_dtype or float32
  // Views (vocabulary.h; TND: sb unused). Any stride is allowed (sliced, transposed views),
  // including 0 for broadcast dims.
  View query;    // BSND [B,S1,N1,D]  TND [T1,N1,D]
  View key;      // BSND [B,S2,N2,D]  TND [T2,N2,D]
  View weights;  // BSND [B,S1,N1]    TND [T1,N1] (sd unused)

  // BSND: per-sequence lengths [B] (each in [0, S]), nullptr meaning every length is S.
  // TND: cumulative ends [B] (no leading 0, non-decreasing, last == T), required.
  const int64_t* seq_q_lens = nullptr;
  const int64_t* seq_k_lens = nullptr;

  // Outputs, contiguous float32: BSND [B,N2,S1], TND [N2,T1].
  float* softmax_max = nullptr;
  float* softmax_sum = nullptr;

  // bf16 inputs at the avx512_bf16 level: -1 chooses bf16 pairs or float32 FMA by measured speed
  // for compute-bound work (kernel_choice.h), 1 forces pairs, 0 forces float32.
  int bf16_pairs = -1;
};

// Throws ArgumentError naming the first argument that is wrong.
void validate(const IndexerParams& params);

// The sequences of a validated call, in token coordinates of the inputs.
std::vector<Sequence> indexer_sequences(const IndexerParams& params);

// Validates, then computes both outputs. Rows with no visible key (and BSND rows past their
// sequence's length) get max = -inf, sum = 0.
void dense_lightning_indexer_softmax_lse(const IndexerParams& params, const Executor& executor,
                                         Isa isa);

}  // namespace opmesh::core
