// dense_lightning_indexer_grad_kl_loss: the KL loss that trains the lightning indexer to match the
// main attention's distribution, and its gradients, fused (never an S1 x S2 matrix).
//
// For one sequence, query token t and the keys j it sees (the indexer's mask):
//   main attention  p[h,t,j] = exp(scale * <q[t,h], k[j,h/G]> - max[h,t]) / sum[h,t]
//                   (q and k concatenated with their rope parts; max/sum given by the caller)
//   target          P[t,j] = sum_h p[h,t,j],  Z[t] = sum_j P[t,j],  phat[t,j] = P[t,j] / Z[t]
//   indexer         S[h,t,j] = <qi[t,h], ki[j,h/Gi]>,  I[g,t,j] = sum_{h in g} w[t,h] relu(S)
//                   q[g,t,j] = exp(I[g,t,j] - max_index[g,t]) / sum_index[g,t]
//   loss            sum over t and index key heads g of KL(phat[t] || q[g,t])
//   gradients       dI[g,t,j] = q[g,t,j] - phat[t,j]
//                   d_weights[t,h] = sum_j dI relu(S)
//                   d_query_index[t,h] = sum_j dI w[t,h] [S > 0] ki[j]
//                   d_key_index[j,g] = sum_t sum_{h in g} dI w[t,h] [S > 0] qi[t,h]
// A row whose target mass Z is zero (no visible key) contributes nothing. A NaN or an infinity
// in any row the call reads makes the loss and every gradient row NaN (reads_non_finite).
//
// Two passes over units a single task owns, so no two tasks write the same element and results
// are bitwise independent of the thread count: query tiles (the loss, Z, d_query_index and
// d_weights, with the target's and the indexer's parts accumulated apart and combined once Z is
// known) and blocks of four key tiles (d_key_index, with Z from the first pass; each query tile
// packed once serves the block).
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

// A tensor operand: its view (vocabulary.h; TND sb 0, weights sd 0) and its dtype.
struct KlOperand : View {
  DType dtype = DType::kFloat32;
};

struct KlGradient : MutableView {
  DType dtype = DType::kFloat32;
};

struct IndexerKlLossParams : Compression {  // compressed keys: Compression (selection.h)
  Layout layout = Layout::kBSND;            // BSND or TND
  MaskMode sparse_mode = MaskMode::kCausal;
  int64_t pre_tokens = std::numeric_limits<int64_t>::max();
  int64_t next_tokens = std::numeric_limits<int64_t>::max();

  int64_t batch = 0;  // B; TND: the number of sequences
  int64_t seq_q = 0;  // S1 or T1
  int64_t seq_k = 0;  // S2 or T2
  // Main attention: N1 query heads, N2 key heads (N1 % N2 == 0), head dim D plus rope dim Dr.
  int64_t heads_q = 0, heads_k = 0, head_dim = 0, rope_dim = 0;
  // Indexer: N1index query heads, N2index key heads, head dim.
  int64_t index_heads_q = 0, index_heads_k = 0, index_dim = 0;
  float scale = 1.0f;

  KlOperand query, key, query_rope, key_rope;  // rope operands only when rope_dim > 0
  KlOperand query_index, key_index, weights;
  // The main attention's statistics, contiguous float32 [B, N2, S1, G] / [N2, T1, G], and the
  // indexer's, [B, N2index, S1] / [N2index, T1].
  const float* softmax_max = nullptr;
  const float* softmax_sum = nullptr;
  const float* softmax_max_index = nullptr;
  const float* softmax_sum_index = nullptr;

  // As IndexerParams: BSND per-sequence lengths or nullptr; TND cumulative ends (required).
  const int64_t* seq_q_lens = nullptr;
  const int64_t* seq_k_lens = nullptr;

  // Outputs, shaped like query_index, key_index and weights. Rows no sequence covers (BSND rows
  // past a length) are not written: the caller zero-fills them.
  KlGradient d_query_index, d_key_index, d_weights;
  float* loss = nullptr;  // one float
};

// The indexer's half of a call, as the softmax-statistics operator sees it: validating it checks
// the index tensors, the layout, the mask and the lengths with that operator's messages.
IndexerParams index_params(const IndexerKlLossParams& params);

// Throws ArgumentError naming the first argument that is wrong. `index_statistics`: whether the
// indexer's statistics are read (the sparse loss computes its own).
void validate(const IndexerKlLossParams& params, bool index_statistics = true);

// Whether a row the call reads holds a NaN or an infinity: query, query_rope, query_index,
// weights and the statistics of the query rows of `seqs`, key, key_rope and key_index of their
// key rows (`index_statistics`: the indexer's statistics too). A statistic's max of -inf is not
// counted: it is what a row that sees no key has.
bool reads_non_finite(const IndexerKlLossParams& params, const std::vector<Sequence>& seqs,
                      bool index_statistics, const Executor& executor);

// What a call that reads one gets: a NaN loss and NaN in every gradient row of `seqs`.
void write_non_finite(const IndexerKlLossParams& params, const std::vector<Sequence>& seqs);

// Validates, then computes the loss and the three gradients on the float32 kernels of `isa`
// (with a non-finite value in a row it reads, the result of write_non_finite).
void dense_lightning_indexer_grad_kl_loss(const IndexerKlLossParams& params,
                                          const Executor& executor, Isa isa);

}  // namespace opmesh::core
