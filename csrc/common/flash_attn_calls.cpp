#include "flash_attn_calls.h"

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

#include "errors.h"

namespace opmesh::calls {
namespace {

using core::ArgumentError;

// The longest sequence of a batch: cu_seqlens differences (or `fallback` without them), each
// capped by seqused when given.
int64_t longest_length(const int32_t* cu, const int32_t* used, int64_t batch, int64_t fallback) {
  int64_t m = 0;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t len = cu ? cu[b + 1] - cu[b] : fallback;
    if (used) len = std::min<int64_t>(len, used[b]);
    m = std::max(m, len);
  }
  return m;
}

void check_token_counts(const attn::PlanConfig& c, const FlashAttnShapes& s,
                        const attn::LengthArrays& lengths) {
  const int64_t batch = c.batch_size;
  if (s.q_tnd && lengths.cu_seqlens_q[batch] != s.q_tokens) {
    throw ArgumentError("cu_seqlens_q",
                        "last entry " + std::to_string(lengths.cu_seqlens_q[batch]) +
                            " must equal the query token count " + std::to_string(s.q_tokens));
  }
  if (s.kv_tnd && lengths.cu_seqlens_kv[batch] != s.kv_tokens) {
    throw ArgumentError("cu_seqlens_kv",
                        "last entry " + std::to_string(lengths.cu_seqlens_kv[batch]) +
                            " must equal the key token count " + std::to_string(s.kv_tokens));
  }
}

}  // namespace

PreparedForward prepare_forward(attn::PlanConfig c, const FlashAttnShapes& s,
                                const attn::LengthArrays& lengths,
                                std::optional<int64_t> max_seqlen_q,
                                std::optional<int64_t> max_seqlen_kv, PlanWords metadata,
                                int64_t workers) {
  PreparedForward out;
  check_token_counts(c, s, lengths);
  const bool use_metadata = metadata.given();
  // The shape's where the layout has a sequence axis, else the caller's, else -1 (left to the
  // metadata) or the observed maximum.
  auto resolve_max = [&](std::optional<int64_t> given, bool from_shape, int64_t shape_value,
                         int64_t observed) -> int64_t {
    if (from_shape) return shape_value;
    if (given.has_value()) return *given;
    return use_metadata ? -1 : observed;
  };
  c.max_seqlen_q =
      resolve_max(max_seqlen_q, !s.q_tnd, s.q_seq,
                  longest_length(lengths.cu_seqlens_q, lengths.seqused_q, c.batch_size, 0));
  c.max_seqlen_kv = resolve_max(max_seqlen_kv, !s.kv_tnd && !s.paged, s.kv_seq,
                                longest_length(lengths.cu_seqlens_kv, lengths.seqused_kv,
                                               c.batch_size, s.paged ? INT32_MAX : 0));
  if (s.paged) {
    for (int64_t b = 0; b < c.batch_size; ++b) {
      if (lengths.seqused_kv[b] > s.blocks_per_seq * s.block_size) {
        throw ArgumentError("seqused_kv", "entry " + std::to_string(b) + " is " +
                                              std::to_string(lengths.seqused_kv[b]) +
                                              ", more than block_table holds (" +
                                              std::to_string(s.blocks_per_seq) + " blocks of " +
                                              std::to_string(s.block_size) + ")");
      }
    }
  }
  if (use_metadata) {
    out.decoded = attn::metadata::read(metadata.words, metadata.size);
    attn::metadata::verify(*out.decoded, c, lengths);
    c.max_seqlen_q = out.decoded->config.max_seqlen_q;
    c.max_seqlen_kv = out.decoded->config.max_seqlen_kv;
    c.num_workers = out.decoded->config.num_workers;
    c.deterministic = out.decoded->config.deterministic;
  } else {
    c.num_workers = workers;
  }
  attn::validate_config(c);
  out.sequences = attn::resolve_sequences(c, lengths);
  if (s.paged) {
    for (int64_t b = 0; b < c.batch_size; ++b) {
      const int64_t used = (out.sequences[b].k_len + s.block_size - 1) / s.block_size;
      for (int64_t j = 0; j < used; ++j) {
        const int32_t blk = s.table[b * s.table_stride_b + j * s.table_stride_j];
        if (blk < 0 || blk >= s.num_blocks) {
          throw ArgumentError("block_table", "entry [" + std::to_string(b) + ", " +
                                                 std::to_string(j) + "] is " + std::to_string(blk) +
                                                 ", expected a block index in [0, " +
                                                 std::to_string(s.num_blocks) + ")");
        }
      }
    }
  }
  if (use_metadata) {
    try {
      attn::verify_coverage(c, out.sequences, out.decoded->plan);
    } catch (const std::logic_error& e) {
      throw ArgumentError("metadata", e.what());
    }
  } else {
    out.own_plan = attn::make_plan(c, out.sequences);
  }
  for (int64_t b = 0; b < c.batch_size && !out.padding; ++b) {
    const int64_t rows = s.q_tnd ? lengths.cu_seqlens_q[b + 1] - lengths.cu_seqlens_q[b] : s.q_seq;
    out.padding = out.sequences[b].q_len < rows;
  }
  if (c.batch_size == 0 && s.q_tnd && s.q_tokens > 0) out.padding = true;
  out.config = c;
  return out;
}

PreparedBackward prepare_backward(attn::PlanConfig c, const FlashAttnShapes& s,
                                  const attn::LengthArrays& lengths,
                                  std::optional<int64_t> max_seqlen_q,
                                  std::optional<int64_t> max_seqlen_kv, PlanWords metadata) {
  PreparedBackward out;
  c.max_seqlen_q = s.q_tnd ? max_seqlen_q.value_or(longest_length(
                                 lengths.cu_seqlens_q, lengths.seqused_q, c.batch_size, 0))
                           : s.q_seq;
  c.max_seqlen_kv = s.kv_tnd ? max_seqlen_kv.value_or(longest_length(
                                   lengths.cu_seqlens_kv, lengths.seqused_kv, c.batch_size, 0))
                             : s.kv_seq;
  // A backward plan, checked against this call (or one made by the core when none is given).
  if (metadata.given()) {
    out.decoded = attn::metadata::read(metadata.words, metadata.size);
    attn::PlanConfig call = c;
    call.backward = true;
    attn::metadata::verify(*out.decoded, call, lengths);
    c.max_seqlen_q = out.decoded->config.max_seqlen_q;
    c.max_seqlen_kv = out.decoded->config.max_seqlen_kv;
  }
  attn::validate_config(c);
  out.sequences = attn::resolve_sequences(c, lengths);
  out.config = c;
  return out;
}

std::vector<int32_t> plan_words(const attn::PlanConfig& c, const attn::LengthArrays& lengths) {
  attn::validate_config(c);
  std::vector<int32_t> words(attn::metadata::size_words(c.num_workers));
  attn::metadata::write(c, lengths, words.data());
  return words;
}

}  // namespace opmesh::calls
