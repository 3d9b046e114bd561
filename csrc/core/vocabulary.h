// The words both operator families use: tensor layouts, masks, sequences of a batch and the keys
// a query row sees. The indexer and flash attention describe their problems with these, so the
// kernel layer, the planner and the bindings agree on them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace opmesh::core {

// Sequence lengths, token counts and windows are stored as int32 in plans and tile positions:
// every such size must stay below this bound (2^31 - 256), checked before anything narrows it.
inline constexpr int64_t kMaxTokens = (int64_t{1} << 31) - 256;
inline constexpr int64_t kMaxBatch = (int64_t{1} << 31) - 1;
inline constexpr int64_t kMaxHeads = int64_t{1} << 16;
inline constexpr int64_t kMaxHeadDim = 2048;

// A window side of kMaxTokens or more covers every key any sequence can have: it is unbounded
// (-1). Smaller values, -1 and invalid ones (< -1, refused by validate_config) pass unchanged.
inline int64_t normalize_window(int64_t w) { return w >= kMaxTokens ? -1 : w; }

// A tensor as the kernels read it: its first element and its element strides along the
// [batch][sequence][head][dim] axes of its layout. TND tensors have sb = 0 and index the sequence
// axis by token; paged caches are [block][slot][head][dim] (sb per block, ss per slot); a tensor
// with fewer axes leaves the missing ones' strides 0 (weights [B, S, N]: sd = 0; a KV-cache
// input [T, N, D]: sb = 0; sparse indices [B, S, N, K]: sd along K).
struct View {
  const void* data = nullptr;
  int64_t sb = 0, ss = 0, sn = 0, sd = 0;
};

// The same for an output the kernel writes.
struct MutableView {
  void* data = nullptr;
  int64_t sb = 0, ss = 0, sn = 0, sd = 0;
};

// v's tensor as an output (the caller owns it writable).
inline MutableView writable(const View& v) {
  return MutableView{const_cast<void*>(v.data), v.sb, v.ss, v.sn, v.sd};
}

// The values are the ones the operators' metadata stores; BSND and TND are the indexer's.
enum class Layout : int32_t { kBSND = 0, kBNSD = 1, kTND = 2, kPagedBBND = 3 };
const char* layout_name(Layout layout);

// 0: every key visible; 3: causal aligned to the bottom-right corner of each sequence; 4: a
// window around that diagonal. The values are the operators' mask_mode / sparse_mode arguments.
enum class MaskMode : int32_t { kNone = 0, kCausal = 3, kWindow = 4 };

// One sequence of the batch, in token coordinates of the input tensors.
struct Sequence {
  // The default diagonal: bottom-right aligned, key k_len - q_len + i is on query row i's.
  static constexpr int64_t kBottomRight = std::numeric_limits<int64_t>::min();

  int64_t q_begin = 0;  // first query token in a TND tensor, 0 otherwise
  int64_t q_len = 0;
  int64_t k_begin = 0;  // first key token in a TND tensor, 0 otherwise
  int64_t k_len = 0;
  int64_t batch = 0;  // index into the batch dim (BSND/BNSD) or the length arrays (TND)
  // The key index on query row 0's diagonal, for slices of a longer sequence whose query and
  // key offsets differ (context parallelism); kBottomRight for k_len - q_len.
  int64_t diagonal = kBottomRight;
  // Compressed keys (Mask::ratio > 1): the sequence's original key tokens past its last whole
  // compressed entry (k_len * ratio + residual original tokens), in [0, ratio).
  int64_t residual = 0;

  int64_t diag() const { return diagonal == kBottomRight ? k_len - q_len : diagonal; }
};

// Which operands a batch of sequences touches: query rows (any q_len > 0) and (query, key)
// pairs (any sequence with both). An operand no sequence touches may be an empty tensor with no
// buffer.
struct SequenceWork {
  bool queries = false;
  bool pairs = false;
};

template <class Sequences>
SequenceWork sequence_work(const Sequences& seqs) {
  SequenceWork w;
  for (const Sequence& s : seqs) {
    w.queries = w.queries || s.q_len > 0;
    w.pairs = w.pairs || (s.q_len > 0 && s.k_len > 0);
  }
  return w;
}

// The mask of a call: mode and, for kWindow, how far left and right of the diagonal a query sees
// (-1: unbounded). With ratio > 1 the keys are compressed, entry j standing for original key
// tokens [j * ratio, (j + 1) * ratio): under kCausal a query sees the entries whose last original
// token is at or before its own diagonal (kWindow is not defined for compressed keys).
struct Mask {
  MaskMode mode = MaskMode::kNone;
  int64_t left = -1;
  int64_t right = -1;
  int64_t ratio = 1;
};

// Key columns visible to query row `i` (0-based in its sequence): [begin, end), possibly empty.
struct KeyRange {
  int64_t begin = 0;
  int64_t end = 0;
};

inline KeyRange visible_keys(const Mask& mask, const Sequence& s, int64_t i) {
  const int64_t diag = i + s.diag();
  int64_t lo = 0;
  int64_t hi = s.k_len;
  if (mask.mode == MaskMode::kCausal && mask.ratio > 1) {
    // The row's diagonal in original key tokens, bottom-right aligned to k_len * ratio +
    // residual of them: entries whose last token is at or before it.
    const int64_t original = i + s.k_len * mask.ratio + s.residual - s.q_len;
    hi = original + 1 >= 0 ? (original + 1) / mask.ratio : 0;
  } else if (mask.mode == MaskMode::kCausal) {
    hi = diag + 1;
  } else if (mask.mode == MaskMode::kWindow) {
    if (mask.left >= 0) lo = diag - mask.left;
    if (mask.right >= 0) hi = diag + mask.right + 1;
  }
  lo = std::max<int64_t>(lo, 0);
  hi = std::min<int64_t>(hi, s.k_len);
  if (hi <= lo) return {0, 0};
  return {lo, hi};
}

}  // namespace opmesh::core
