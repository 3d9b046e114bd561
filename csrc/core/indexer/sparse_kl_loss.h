// sparse_lightning_indexer_grad_kl_loss: the KL loss of indexer_kl_loss.h restricted, per token t
// and index key head g, to the keys S(t, g) that sparse_indices select among the visible ones:
//   target   P[t,j] = sum_h exp(scale <q[t,h], k[j,h/G]> - lse[h,t]),  j in S(t,g)
//            phat = P / sum_{j in S} P   (a row with no target mass contributes nothing)
//   indexer  I[g,t,j] = sum_{h in g} w[t,h] relu(<qi[t,h], ki[j,g]>),  q = softmax of I over S
//   loss     sum_t sum_g KL(phat || q),  dI = q - phat on S, 0 elsewhere
// with the gradients of the dense loss, summed over S instead of every visible key.
//
// Two passes, deterministic for any executor:
// - per token (tasks of a few tokens): the selected main keys, 64 at a time, give P through the
//   kernel set's products and exp_rows; the index scores of the same keys give I (kept for the
//   row: O(N1index x K) floats per worker), then the row's loss, dI, d_weights and
//   d_query_index. dI is kept per selection entry (one float per entry of sparse_indices);
// - per block of keys owned by one worker: d_key_index of each key, summed over the tokens that
//   selected it in token order, from the kept dI and the index scores' signs (kept by the first
//   pass within a memory budget, else recomputed).
// No S1 x S2 buffer; the loss is summed in a fixed order in double.
#pragma once

#include <cstdint>

#include "indexer_kl_loss.h"

namespace opmesh::core {

struct SparseKlLossParams {
  // Layout, mask, sizes, operands, the main statistics (the sparse attention's over the same
  // selected keys: [B, N2, S1, G] / [N2, T1, G]) and the outputs, as for the dense loss; the
  // index statistics are not read.
  IndexerKlLossParams dense;
  // sparse_indices [B, S1, index_heads, K] / [T1, index_heads, K]: key positions within the
  // sequence, -1 skipped, int32; sd along K (TND: sb unused). index_heads is N2index, or 1 for
  // one selection that every index key head uses.
  View indices;
  int64_t index_heads = 1;
  int64_t sparse_count = 0;
  // The second pass needs the sign of each index score (head h of a group, selection entry e).
  // The first pass keeps them (ceil(G_index / 8) bytes per entry of sparse_indices) when they fit
  // in this many bytes; otherwise the second pass recomputes the scores. Both give the same bits.
  int64_t sign_budget_bytes = int64_t{1} << 30;
};

// Throws ArgumentError naming the first argument that is wrong, sparse_indices' values included
// (an entry below -1, past its sequence's keys, or repeated in one row).
void validate(const SparseKlLossParams& params);

// Validates, then computes the loss and the three gradients on the float32 kernels of `isa`.
// Rows of the gradients that no sequence covers are not written (the caller zero-fills them).
void sparse_lightning_indexer_grad_kl_loss(const SparseKlLossParams& params,
                                           const Executor& executor, Isa isa);

}  // namespace opmesh::core
