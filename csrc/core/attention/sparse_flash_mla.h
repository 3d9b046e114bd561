// sparse_flash_mla: shared key/value attention of each query token over a window of original
// keys (ori_kv) and over compressed keys (cmp_kv: all those its position has passed, or a top-k
// of them), one softmax over both and the sink:
//   s[t, h, j] = scale * q[t, h] . kv[j, g],  g = h / (N1 / N2)
//   out[t, h]  = sum_j p[t, h, j] kv[j, g],  p = softmax over the row's keys of both and the sink
// Work and memory: O(tile) per worker, no S1 x S2 buffer; results, gradients included, are the
// same bits for any executor (the sparse attention kernels of sparse_attention_detail.h).
#pragma once

#include <cstdint>
#include <vector>

#include "../cpu_features.h"
#include "../dtype.h"
#include "../executor.h"
#include "../selection.h"
#include "../vocabulary.h"
#include "sparse_attention.h"

namespace opmesh::core {

namespace sparse {
struct TokenSchedule;
}

// One of the two key/value tensors and how a query row selects its keys.
struct MlaKeys : PagedKeys {  // paged keys: the PagedKeys base (host table)
  bool present = false;
  View kv;          // [B, S, N2, D] / [T, N2, D] / paged [blocks, block_size, N2, D]
  int64_t seq = 0;  // BSND: S; TND: T; paged: unused
  // Lengths (host copies): TND cumulative cu_seqlens [B + 1] (from 0, last == T), required;
  // seqused [B] (nullptr: the layout's lengths), required for paged keys.
  const int64_t* cu_seqlens = nullptr;
  const int64_t* seqused = nullptr;
  // The mask: kNone, kCausal (bottom-right aligned; compressed keys by cmp_ratio) or kWindow
  // (win_left / win_right around the diagonal, -1 unbounded; original keys only).
  MaskMode mask_mode = MaskMode::kNone;
  int64_t win_left = -1;
  int64_t win_right = -1;
  // A top-k selection: int32 [B, S1, N2, K] / [T1, N2, K] (sd along K), -1 skipped, kept within
  // the mask; data nullptr: every key the mask lets the row see. topk_length int32 [B, S1, N2] /
  // [T1, N2]: how many leading entries count (data nullptr: K).
  View indices;
  int64_t topk = 0;
  View topk_length;
  // A quantized kv (int8 / e4m3, one byte per element, unit stride along D): row (s, j, g) reads
  // as kv[s, j, g] * scale[s, j, g] (float32, kv's shape without D, strides sb, ss, sn).
  CacheFormat format = CacheFormat::kPlain;
  View scale;
};

struct SparseFlashMlaParams {
  Layout layout_q = Layout::kBSND;        // BSND or TND
  Layout layout_kv = Layout::kBSND;       // layout_q's, or kPagedBBND
  int64_t batch = 0;                      // B
  int64_t seq_q = 0;                      // BSND: S1; TND: T1
  int64_t heads_q = 0;                    // N1, a multiple of N2
  int64_t heads_kv = 0;                   // N2
  int64_t head_dim = 0;                   // D of q and both key tensors
  const int64_t* cu_seqlens_q = nullptr;  // TND [B + 1], required
  const int64_t* seqused_q = nullptr;     // [B] or nullptr

  MlaKeys ori;
  MlaKeys cmp;
  // Compressed entry j of cmp_kv stands for original tokens [j * cmp_ratio, (j + 1) * cmp_ratio);
  // a sequence's original length is cmp_len * cmp_ratio + residual (cmp_residuals [B] in
  // [0, cmp_ratio), nullptr: 0).
  int64_t cmp_ratio = 1;
  const int64_t* cmp_residuals = nullptr;

  float scale = 1.0f;
  DType dtype = DType::kFloat32;  // q, ori_kv, cmp_kv and the output
  View q;
  const float* sinks = nullptr;  // [N1] or nullptr

  MutableView out;               // q's shape and layout
  float* softmax_lse = nullptr;  // [B, N2, S1, G] / [N2, T1, G] float32 contiguous, or nullptr
};

// The backward's extra inputs and outputs: sparse attention's (dout, out, softmax_lse and dlse,
// dq, dsinks; its key-side gradients unused) and the two key tensors' gradients, contiguous in
// their input's shape and dtype; rows nothing reaches get zeros.
struct SparseFlashMlaGrads : SparseAttentionGrads {
  void* d_ori_kv = nullptr;  // when ori_kv is present
  void* d_cmp_kv = nullptr;  // when cmp_kv is present
};

// Throws ArgumentError naming the first argument that is wrong, the selections' values included.
void validate(const SparseFlashMlaParams& params);

// The query sequences, each with ori_kv's keys (k_len 0 without ori_kv), and cmp_kv's sequences
// (with their residuals), both indexed by batch.
struct MlaSequences {
  std::vector<Sequence> ori;
  std::vector<Sequence> cmp;
};
MlaSequences sparse_flash_mla_sequences(const SparseFlashMlaParams& params);

// The masks of the two key tensors (cmp_kv's with cmp_ratio).
Mask ori_mask(const SparseFlashMlaParams& params);
Mask cmp_mask(const SparseFlashMlaParams& params);

// Validates, then writes out and (when given) softmax_lse. A row with no key gets a zero output.
// With a schedule (a plan's), each worker task runs one of its groups.
void sparse_flash_mla(const SparseFlashMlaParams& params, const Executor& executor, Isa isa,
                      const sparse::TokenSchedule* schedule = nullptr);

// Validates, then writes the gradients (paged keys and quantized ones have none: both are
// refused).
void sparse_flash_mla_backward(const SparseFlashMlaParams& params, const SparseFlashMlaGrads& grads,
                               const Executor& executor, Isa isa);

}  // namespace opmesh::core
